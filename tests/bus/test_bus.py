"""The bus layer against a real nats-server: publish, consume, verdicts, tracing, restarts."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from schemas import InvalidMessage, RunEvicted, RunSubmitted, decode, encode
from services.bus import (
    Bus,
    BusUnavailable,
    Consumer,
    Delivery,
    EmbeddedNats,
    PayloadTooLarge,
    Reject,
    Retry,
    flushed,
    free_port,
    provision,
    setup_tracing,
)
from services.bus.tracing import tracer

_exporter = InMemorySpanExporter()
setup_tracing("test", extra_processor=SimpleSpanProcessor(_exporter))


async def _errors_after(bus: Bus, service: str, seq_floor: int = 0) -> list[InvalidMessage]:
    """Every InvalidMessage on plexrl.errors.<service>, read straight from the stream."""
    out = []
    info = await bus.js.stream_info("PLEXRL_ERRORS")
    for seq in range(max(seq_floor, info.state.first_seq), info.state.last_seq + 1):
        try:
            raw = await bus.js.get_msg("PLEXRL_ERRORS", seq)
        except Exception:
            continue
        if raw.subject == f"plexrl.errors.{service}":
            ev = decode(raw.data, InvalidMessage)
            out.append(ev)
    return out


def _consumer(bus: Bus, uid: str, event_type=RunEvicted) -> Consumer:
    return Consumer(
        bus,
        stream="PLEXRL_RUNS",
        durable=f"t_{uid}",
        filter_subject=f"plexrl.runs.evicted.{uid}",
        event_type=event_type,
        ack_wait=5.0,
    )


async def _run_until(
    consumer: Consumer, handler, done: asyncio.Event, timeout: float = 10.0
) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(handler, stop))
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        stop.set()
        await task
        await consumer.close()


def _evicted(uid: str, i: int = 0) -> RunEvicted:
    return RunEvicted(run_id=f"run_{uid}", idx=i, reason=f"reason {i}")


async def test_duplicate_msg_id_is_stored_once(bus: Bus, uid: str) -> None:
    subject = f"plexrl.runs.evicted.{uid}"
    first = await bus.publish(subject, _evicted(uid), msg_id=f"dup-{uid}")
    second = await bus.publish(subject, _evicted(uid), msg_id=f"dup-{uid}")
    third = await bus.publish(subject, _evicted(uid, 1), msg_id=f"other-{uid}")
    assert not first.duplicate
    assert second.duplicate and second.seq == first.seq
    assert third.seq == first.seq + 1
    got: list[RunEvicted] = []
    done = asyncio.Event()

    async def handler(ev: RunEvicted, d: Delivery) -> None:
        got.append(ev)
        if len(got) == 2:
            done.set()

    await _run_until(_consumer(bus, uid), handler, done)
    assert [e.idx for e in got] == [0, 1]


async def test_nak_redelivers(bus: Bus, uid: str) -> None:
    await bus.publish(f"plexrl.runs.evicted.{uid}", _evicted(uid))
    deliveries: list[int] = []
    done = asyncio.Event()

    async def handler(ev: RunEvicted, d: Delivery) -> None:
        deliveries.append(d.num_delivered)
        if d.num_delivered == 1:
            raise Retry("not yet", delay=0.1)
        done.set()

    await _run_until(_consumer(bus, uid), handler, done)
    assert deliveries == [1, 2]


async def test_handler_exception_redelivers(bus: Bus, uid: str) -> None:
    await bus.publish(f"plexrl.runs.evicted.{uid}", _evicted(uid))
    deliveries: list[int] = []
    done = asyncio.Event()

    async def handler(ev: RunEvicted, d: Delivery) -> None:
        deliveries.append(d.num_delivered)
        if d.num_delivered == 1:
            raise RuntimeError("transient disk hiccup")
        done.set()

    await _run_until(_consumer(bus, uid), handler, done)
    assert deliveries == [1, 2]


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b'{"type": "run_evicted", "run_id": "run_x", "idx": 0, "reason": ', "truncated"),
        (b'{"type": "no_such_event", "run_id": "run_x"}', "$.type"),
        (b'{"type": "run_evicted", "run_id": "run_../x", "idx": 0, "reason": "r"}', "$.run_id"),
        (b'{"type": "run_evicted", "run_id": "run_x", "idx": -1, "reason": "r"}', "$.idx"),
        (b"\xff\xfe not json at all", "malformed"),
    ],
)
async def test_bad_message_is_terminated_and_reported(
    bus: Bus, uid: str, payload: bytes, expected: str
) -> None:
    subject = f"plexrl.runs.evicted.{uid}"
    floor = (await bus.js.stream_info("PLEXRL_ERRORS")).state.last_seq + 1
    await bus.js.publish(subject, payload)
    await bus.publish(subject, _evicted(uid, 7))
    got: list[RunEvicted] = []
    done = asyncio.Event()

    async def handler(ev: RunEvicted, d: Delivery) -> None:
        got.append(ev)
        done.set()

    consumer = _consumer(bus, uid)
    await _run_until(consumer, handler, done)
    assert [e.idx for e in got] == [7]  # the service kept serving
    assert bus.invalid_count == 1
    reports = await _errors_after(bus, "test", floor)
    assert len(reports) == 1
    report = reports[0]
    assert report.subject == subject
    assert expected.lower() in report.error.lower()
    assert report.leading_bytes == payload[:256]
    # terminated, not redelivered: nothing left pending for this consumer
    info = await bus.js.consumer_info("PLEXRL_RUNS", f"t_{uid}")
    assert info.num_pending == 0 and info.num_ack_pending == 0


async def test_invalid_report_is_plain_json_with_base64(bus: Bus, uid: str) -> None:
    subject = f"plexrl.runs.evicted.{uid}"
    floor = (await bus.js.stream_info("PLEXRL_ERRORS")).state.last_seq + 1
    await bus.report_invalid(subject, "bad thing", b"\x00\x01abc")
    info = await bus.js.stream_info("PLEXRL_ERRORS")
    raw = await bus.js.get_msg("PLEXRL_ERRORS", info.state.last_seq)
    assert info.state.last_seq >= floor
    doc = json.loads(raw.data)
    assert doc["type"] == "invalid_message"
    assert base64.b64decode(doc["leading_bytes"]) == b"\x00\x01abc"


async def test_reject_from_handler_terminates_and_reports(bus: Bus, uid: str) -> None:
    floor = (await bus.js.stream_info("PLEXRL_ERRORS")).state.last_seq + 1
    await bus.publish(f"plexrl.runs.evicted.{uid}", _evicted(uid))
    calls = 0
    done = asyncio.Event()

    async def handler(ev: RunEvicted, d: Delivery) -> None:
        nonlocal calls
        calls += 1
        done.set()
        raise Reject("run_x is not a run this service knows")

    await _run_until(_consumer(bus, uid), handler, done)
    await asyncio.sleep(0.3)
    assert calls == 1
    reports = await _errors_after(bus, "test", floor)
    assert [r.error for r in reports] == ["run_x is not a run this service knows"]


async def test_msgpack_and_json_both_accepted(bus: Bus, uid: str) -> None:
    subject = f"plexrl.runs.evicted.{uid}"
    await bus.publish(subject, _evicted(uid, 1), fmt="json")
    await bus.publish(subject, _evicted(uid, 2), fmt="msgpack")
    # a client in another language sending plain JSON without any header
    await bus.js.publish(
        subject, b'{"type":"run_evicted","run_id":"run_%s","idx":3,"reason":"r"}' % uid.encode()
    )
    got: list[tuple[int, str]] = []
    done = asyncio.Event()

    async def handler(ev: RunEvicted, d: Delivery) -> None:
        got.append((ev.idx, d.headers.get("Content-Type", "")))
        if len(got) == 3:
            done.set()

    await _run_until(_consumer(bus, uid), handler, done)
    assert got == [(1, "application/json"), (2, "application/msgpack"), (3, "")]
    raw = await bus.js.get_last_msg("PLEXRL_RUNS", subject)
    assert raw.data.startswith(b"{")


async def test_trace_context_travels_from_publisher_to_handler(bus: Bus, uid: str) -> None:
    _exporter.clear()
    with tracer("test").start_as_current_span("orchestrator step") as root:
        await bus.publish(f"plexrl.runs.evicted.{uid}", _evicted(uid))
    root_ctx = root.get_span_context()
    seen = {}
    done = asyncio.Event()

    async def handler(ev: RunEvicted, d: Delivery) -> None:
        from opentelemetry import trace

        seen["trace_id"] = trace.get_current_span().get_span_context().trace_id
        seen["traceparent"] = d.headers.get("traceparent", "")
        done.set()

    await _run_until(_consumer(bus, uid), handler, done)
    assert seen["trace_id"] == root_ctx.trace_id
    assert seen["traceparent"].split("-")[1] == format(root_ctx.trace_id, "032x")
    spans = {
        s.name: s for s in _exporter.get_finished_spans() if s.context.trace_id == root_ctx.trace_id
    }
    publish = spans[f"publish plexrl.runs.evicted.{uid}"]
    handle = spans[f"handle plexrl.runs.evicted.{uid}"]
    assert publish.parent.span_id == root_ctx.span_id
    assert handle.parent.span_id == publish.context.span_id
    assert [link.context.span_id for link in handle.links] == [publish.context.span_id]


async def test_provisioning_twice_changes_nothing(bus: Bus) -> None:
    before = {
        s: await bus.js.stream_info(s)
        for s in ("PLEXRL_RUNS", "PLEXRL_ROLLOUTS", "PLEXRL_WEIGHTS", "PLEXRL_ERRORS")
    }
    assert await provision(bus.js) == []
    assert await provision(bus.js) == []
    for name, info in before.items():
        after = await bus.js.stream_info(name)
        assert after.created == info.created
        assert after.config.subjects == info.config.subjects
        assert after.state.messages >= info.state.messages
    for bucket in ("plexrl-registry", "plexrl-progress"):
        kv = await bus.js.key_value(bucket)
        assert (await kv.status()).bucket == bucket
    await bus.js.object_store("plexrl-weights")


async def test_provisioning_updates_a_drifted_stream(tmp_path: Path) -> None:
    with EmbeddedNats(store_dir=tmp_path) as server:
        b = await Bus.connect(server.url, "test")
        info = await b.js.stream_info("PLEXRL_WEIGHTS")
        import dataclasses

        await b.js.update_stream(dataclasses.replace(info.config, max_msgs_per_subject=1))
        assert await provision(b.js) == ["updated stream PLEXRL_WEIGHTS"]
        assert (await b.js.stream_info("PLEXRL_WEIGHTS")).config.max_msgs_per_subject == 8
        await b.close()


async def test_once_flushed_a_subscription_answers_requests_from_any_connection(
    nats_url: str,
) -> None:
    """What services rely on when they start serving: after ``subscribe`` and ``flushed``, a
    request from another connection finds the responder. (nats-py's ``flush`` alone failed
    this about 4 times in 1,000 here: its PING can overtake the SUB.)"""
    import nats as nats_py

    serving, asking = await nats_py.connect(nats_url), await nats_py.connect(nats_url)

    async def answer(msg: Any) -> None:
        await msg.respond(b"here")

    try:
        for i in range(1000):
            sub = await serving.subscribe(f"test.flushed.{i}", cb=answer)
            await flushed(serving)
            assert (await asking.request(f"test.flushed.{i}", b"", timeout=10)).data == b"here"
            await sub.unsubscribe()
    finally:
        await serving.close()
        await asking.close()


async def test_unreachable_server_gives_a_clear_error() -> None:
    port = free_port()
    with pytest.raises(BusUnavailable) as err:
        await Bus.connect(f"nats://127.0.0.1:{port}", "test", connect_timeout=0.5)
    assert f"127.0.0.1:{port}" in str(err.value)
    assert "PLEXRL_NATS_URL" in str(err.value)


async def test_oversized_event_is_refused_with_advice(bus: Bus, uid: str) -> None:
    huge = RunSubmitted(run_id=f"run_{uid}", config={"blob": "x" * (bus.nc.max_payload + 10)})
    with pytest.raises(PayloadTooLarge, match="by reference"):
        await bus.publish("plexrl.runs.submit", huge)


async def test_reconnect_after_server_restart_loses_nothing_acked(tmp_path: Path, uid: str) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "js")
    server.start()
    try:
        b = await Bus.connect(server.url, "test")
        subject = f"plexrl.runs.evicted.{uid}"
        for i in range(5):
            await b.publish(subject, _evicted(uid, i), msg_id=f"{uid}-{i}")
        server.kill()  # a crash, not a clean shutdown
        await asyncio.sleep(0.3)
        assert not b.nc.is_connected
        server.start()  # same port, same store directory
        for i in range(5, 8):
            await b.publish(subject, _evicted(uid, i), msg_id=f"{uid}-{i}")
        assert b.nc.is_connected
        got: list[int] = []
        done = asyncio.Event()

        async def handler(ev: RunEvicted, d: Delivery) -> None:
            got.append(ev.idx)
            if len(got) == 8:
                done.set()

        await _run_until(_consumer(b, uid), handler, done, timeout=15.0)
        assert got == list(range(8))
        await b.close()
    finally:
        server.close()


def test_codec_roundtrip_both_formats() -> None:
    ev = RunSubmitted(run_id="run_abc", config={"env": "copy", "max_steps": 3})
    assert decode(encode(ev), RunSubmitted) == ev
    assert decode(encode(ev, "msgpack"), RunSubmitted, "application/msgpack") == ev
    assert msgspec.json.decode(encode(ev))["type"] == "run_submitted"


def test_stream_replicas_setting() -> None:
    from services.config import process_settings

    assert process_settings({}).stream_replicas == 1
    assert process_settings({"PLEXRL_STREAM_REPLICAS": "3"}).stream_replicas == 3
    for bad in ("0", "6", "three", "-1", ""):
        with pytest.raises(ValueError, match="PLEXRL_STREAM_REPLICAS"):
            process_settings({"PLEXRL_STREAM_REPLICAS": bad})


async def test_provisioning_never_lowers_replicas(bus: Bus) -> None:
    # A single server holds one copy; asking for one must leave an R1 stream as it is.
    assert await provision(bus.js, replicas=1) == []


def test_embedded_server_dies_with_its_parent(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys
    import time

    script = (
        "import os\n"
        "from services.bus import EmbeddedNats\n"
        f"s = EmbeddedNats(store_dir={str(tmp_path)!r})\n"
        "s.start()\n"
        "print(s.proc.pid, flush=True)\n"
        "os._exit(9)  # a crash: no cleanup runs\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 10
    alive = True
    while alive and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                alive = f.read().split()[2] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            alive = False
        time.sleep(0.1)
    assert not alive, f"nats-server {pid} outlived its parent"


def test_a_port_someone_else_listens_on_is_never_mistaken_for_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process may take the port the server was to use before it binds it (two test
    workers picking ports at once). A connection to the port would succeed all the same; the
    server's own word decides: asked for that port, it fails with the reason; on a port it
    picked itself, it moves to another."""
    import socket

    from services.bus import server as server_module

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with pytest.raises(server_module.NatsServerError, match="another process has the port"):
            EmbeddedNats(store_dir=tmp_path / "asked", port=taken).start()
        picks = iter([taken])
        real_free_port = server_module.free_port
        monkeypatch.setattr(
            server_module,
            "free_port",
            lambda host="127.0.0.1": next(picks, None) or real_free_port(host),
        )
        with EmbeddedNats(store_dir=tmp_path / "picked") as moved:
            assert moved.port != taken
            with socket.create_connection(("127.0.0.1", moved.port), timeout=5) as conn:
                assert conn.recv(4) == b"INFO"
