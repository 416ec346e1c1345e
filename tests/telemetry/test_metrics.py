"""Prometheus metrics: the scrape endpoint, the invalid-message counter and the queue depth."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from schemas.events import RunEvicted
from services.bus import Bus, Consumer, Delivery
from services.telemetry import metrics as telemetry
from services.telemetry.metrics import metrics_address, setup_metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(address: tuple[str, int]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float | None:
    for (sample_name, sample_labels), value in samples.items():
        if sample_name == name and set(labels.items()) <= sample_labels:
            return float(value)
    return None


@pytest.fixture(scope="module")
def served() -> tuple[str, int]:
    """This test process serves /metrics (the first setup with a port in a process wins)."""
    if telemetry.served_address() is None:
        setup_metrics("test", {"PLEXRL_METRICS_PORT": str(_free_port())})
    address = telemetry.served_address()
    assert address is not None
    return address


def test_port_settings() -> None:
    assert metrics_address({}) is None
    assert metrics_address({"PLEXRL_METRICS_PORT": "0"}) is None
    assert metrics_address({"PLEXRL_METRICS_PORT": "9464"}) == ("127.0.0.1", 9464)
    assert metrics_address(
        {"OTEL_EXPORTER_PROMETHEUS_PORT": "9465", "OTEL_EXPORTER_PROMETHEUS_HOST": "0.0.0.0"}
    ) == ("0.0.0.0", 9465)
    assert metrics_address(
        {"PLEXRL_METRICS_PORT": "9000", "OTEL_EXPORTER_PROMETHEUS_PORT": "9465"}
    ) == ("127.0.0.1", 9000)
    with pytest.raises(ValueError, match="PLEXRL_METRICS_PORT"):
        metrics_address({"PLEXRL_METRICS_PORT": "http"})


async def test_invalid_messages_are_counted_on_the_scrape_endpoint(
    served: tuple[str, int], bus: Bus, uid: str
) -> None:
    subject = f"plexrl.runs.evicted.{uid}"
    await bus.js.publish(subject, b'{"type": "run_evicted", "run_id": "run_x", "idx": -1}')
    await bus.js.publish(subject, b"\xff not json")
    await bus.publish(subject, RunEvicted(run_id=f"run_{uid}", idx=3, reason="metrics test"))
    consumer: Consumer[RunEvicted] = Consumer(
        bus, stream="PLEXRL_RUNS", durable=f"m_{uid}", filter_subject=subject, event_type=RunEvicted
    )
    got: list[RunEvicted] = []
    done = asyncio.Event()

    async def handler(event: RunEvicted, delivery: Delivery) -> None:
        got.append(event)
        done.set()

    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(handler, stop))
    await asyncio.wait_for(done.wait(), 10)
    stop.set()
    await task
    await consumer.close()

    samples = _scrape(served)
    assert [e.idx for e in got] == [3]
    assert _value(samples, "plexrl_invalid_messages_total", service="test", subject=subject) == 2.0
    assert _value(samples, "target_info", service_name="plexrl-test") == 1.0


async def test_queue_depth_is_what_the_consumer_has_left(
    served: tuple[str, int], bus: Bus, uid: str
) -> None:
    subject = f"plexrl.runs.evicted.{uid}"
    for i in range(3):
        await bus.publish(subject, RunEvicted(run_id=f"run_{uid}", idx=i, reason="depth"))
    consumer: Consumer[RunEvicted] = Consumer(
        bus, stream="PLEXRL_RUNS", durable=f"q_{uid}", filter_subject=subject, event_type=RunEvicted
    )
    try:
        first = await consumer.fetch(batch=1, timeout=5)
        assert len(first) == 1
        depth = _value(_scrape(served), "plexrl_queue_depth", service="test", consumer=f"q_{uid}")
        assert depth == 2.0
        for _, delivery in first + await consumer.fetch(batch=2, timeout=5):
            await delivery.ack()
        assert await consumer.fetch(batch=1, timeout=0.2) == []
        depth = _value(_scrape(served), "plexrl_queue_depth", service="test", consumer=f"q_{uid}")
        assert depth == 0.0
    finally:
        await consumer.close()


def test_step_and_weight_sync_instruments_are_exported(served: tuple[str, int], uid: str) -> None:
    run_id = f"run_{uid}"
    telemetry.record_step(run_id, step=4, reward_mean=0.25, policy_lag=1, tokens_per_s=120.0)
    telemetry.record_weight_sync(run_id, 0.3)
    telemetry.record_request_served(run_id, ok=True)
    samples = _scrape(served)
    assert _value(samples, "plexrl_step", run_id=run_id, tenant="default") == 4.0
    assert _value(samples, "plexrl_reward", run_id=run_id) == 0.25
    assert _value(samples, "plexrl_policy_lag", run_id=run_id) == 1.0
    assert _value(samples, "plexrl_tokens_per_second", run_id=run_id) == 120.0
    assert _value(samples, "plexrl_weight_sync_latency_seconds_count", run_id=run_id) == 1.0
    assert _value(samples, "plexrl_weight_sync_latency_seconds_sum", run_id=run_id) == 0.3
    assert _value(samples, "plexrl_requests_served_total", run_id=run_id, outcome="ok") == 1.0


def test_per_run_instruments_carry_the_tenant(served: tuple[str, int], uid: str) -> None:
    run_id = f"run_{uid}"
    telemetry.record_trainer_step(
        run_id, seconds=0.5, tokens=120, samples=8, queue_wait=1.5, tenant="acme"
    )
    telemetry.record_trainer_step(run_id, seconds=0.25, tokens=30, samples=2, tenant="acme")
    telemetry.record_request_served(run_id, ok=False, tenant="acme", seconds=0.2, tokens=0)
    telemetry.record_request_served(run_id, ok=True, tenant="acme", seconds=0.4, tokens=12)
    telemetry.record_weight_sync(run_id, 0.1, tenant="acme")
    telemetry.record_step(
        run_id, step=2, reward_mean=0.5, policy_lag=0, tokens_per_s=9.0, tenant="acme"
    )
    samples = _scrape(served)
    labels = {"run_id": run_id, "tenant": "acme"}
    assert _value(samples, "plexrl_trainer_tokens_total", **labels) == 150.0
    assert _value(samples, "plexrl_trainer_samples_total", **labels) == 10.0
    assert _value(samples, "plexrl_trainer_step_seconds_count", **labels) == 2.0
    assert _value(samples, "plexrl_trainer_queue_wait_seconds_count", **labels) == 1.0
    assert _value(samples, "plexrl_trainer_queue_wait_seconds_sum", **labels) == 1.5
    assert _value(samples, "plexrl_requests_served_total", outcome="ok", **labels) == 1.0
    assert _value(samples, "plexrl_requests_served_total", outcome="error", **labels) == 1.0
    assert _value(samples, "plexrl_generate_wait_seconds_count", **labels) == 2.0
    assert _value(samples, "plexrl_generated_tokens_total", **labels) == 12.0
    assert _value(samples, "plexrl_weight_sync_latency_seconds_count", **labels) == 1.0
    assert _value(samples, "plexrl_step", **labels) == 2.0
    # a run of the default tenant is labelled so, and never mixed with another tenant's
    telemetry.record_trainer_step(run_id, seconds=0.1, tokens=7)
    samples = _scrape(served)
    assert _value(samples, "plexrl_trainer_tokens_total", run_id=run_id, tenant="default") == 7.0
    assert _value(samples, "plexrl_trainer_tokens_total", **labels) == 150.0


def test_paused_operations_are_a_gauge_and_their_count_a_counter(
    served: tuple[str, int], uid: str
) -> None:
    store = f"stream T_{uid}"
    telemetry.record_pause("store_full", store, 1)
    telemetry.record_pause("store_full", store, 1)
    telemetry.record_pause("store_full", store, -1)
    samples = _scrape(served)
    labels = {"reason": "store_full", "store": store}
    assert _value(samples, "plexrl_paused_operations", **labels) == 1.0
    assert _value(samples, "plexrl_pauses_total", **labels) == 2.0
