"""Storage limits on a real nats-server: stated, applied by provisioning, and what a writer
does when one is reached (pause, say why, resume), or when an event is too big to send."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from nats.js import api
from nats.js.errors import NotFoundError

from schemas.codec import decode
from schemas.events import RolloutBatch, RunSubmitted, Sample, ServiceError
from schemas.records import Progress
from schemas.subjects import rollouts_subject
from services.bus import Bus, EmbeddedNats, PayloadTooLarge, limits, provision
from services.bus.errors import StoppedWaiting, StorageFull
from services.bus.limits import purge_consumed
from services.cli import main
from services.config import process_settings
from services.runs.progress import read_progress, write_progress
from services.weights.blobs import get_blob, write_blob

MiB = 1 << 20
RUN = "run_limits"
UNLIMITED = {
    name: "0"
    for name in (
        "PLEXRL_RUNS_MAX_BYTES",
        "PLEXRL_ROLLOUTS_MAX_BYTES",
        "PLEXRL_WEIGHTS_EVENTS_MAX_BYTES",
        "PLEXRL_ERRORS_MAX_BYTES",
        "PLEXRL_KV_MAX_BYTES",
        "PLEXRL_WEIGHTS_STORE_MAX_BYTES",
        "PLEXRL_TENANT_WEIGHTS_STORE_MAX_BYTES",
    )
}


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A paused write tries again every 0.1 s here (10 s at most in a deployment)."""
    monkeypatch.setattr(limits, "FIRST_DELAY", 0.05)
    monkeypatch.setattr(limits, "MAX_DELAY", 0.1)


def _set_env(monkeypatch: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def _batch(step: int, tokens: int = 100) -> RolloutBatch:
    sample = Sample(
        prompt_ids=[1, 2],
        completion_ids=[3] * tokens,
        completion_logprobs=[-0.5] * tokens,
        reward=1.0,
        advantage=0.5,
    )
    return RolloutBatch(run_id=RUN, step=step, policy_version=step, samples=[sample])


async def _eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.02)


def _paused(caplog: pytest.LogCaptureFixture) -> Callable[[], bool]:
    return lambda: any("paused" in r.getMessage() for r in caplog.records)


async def _fill(publish: Callable[[int], Awaitable[object]]) -> int:
    """Call ``publish(i)`` for i = 0, 1, ... until it raises StorageFull; returns that i."""
    for i in range(10_000):
        try:
            await publish(i)
        except StorageFull:
            return i
    raise AssertionError("never full")


async def test_provisioning_gives_every_stream_bucket_and_store_its_stated_limits(
    server: EmbeddedNats,
) -> None:
    bus = await Bus.connect(server.url, "test")
    try:
        defaults = process_settings({})
        streams = {
            name: (await bus.js.stream_info(name)).config
            for name in ("PLEXRL_RUNS", "PLEXRL_ROLLOUTS", "PLEXRL_WEIGHTS", "PLEXRL_ERRORS")
        }
        new, old = api.DiscardPolicy.NEW, api.DiscardPolicy.OLD
        got = {
            name: (c.max_bytes, c.max_age or 0, c.max_msgs_per_subject, c.discard)
            for name, c in streams.items()
        }
        assert got == {
            "PLEXRL_RUNS": (256 * MiB, 0, -1, new),
            "PLEXRL_ROLLOUTS": (2048 * MiB, 7 * 24 * 3600.0, -1, new),
            "PLEXRL_WEIGHTS": (64 * MiB, 0, 8, new),
            "PLEXRL_ERRORS": (256 * MiB, 7 * 24 * 3600.0, -1, old),
        }
        assert defaults.runs_max_bytes == 256 * MiB
        for bucket in ("KV_plexrl-registry", "KV_plexrl-progress"):
            config = (await bus.js.stream_info(bucket)).config
            assert (config.max_bytes, config.max_msgs_per_subject, config.discard) == (
                64 * MiB,
                5,
                new,
            )
        store = (await bus.js.stream_info("OBJ_plexrl-weights")).config
        assert (store.max_bytes, store.discard) == (2048 * MiB, new)
        # A tenant's store is created on first use with its own limit.
        await write_blob(bus, "run_x/step_1", b"w", bucket="plexrl-weights-acme")
        tenant = (await bus.js.stream_info("OBJ_plexrl-weights-acme")).config
        assert tenant.max_bytes == 512 * MiB
        assert await provision(bus.js) == []
    finally:
        await bus.close()


async def test_limits_are_settings_and_provisioning_applies_them_to_an_existing_deployment(
    server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A deployment provisioned before the limits existed: no byte limits, discard old.
    old = await Bus.connect(server.url, "old", provision_streams=False)
    for name, subjects in (
        ("PLEXRL_RUNS", ["plexrl.runs.>"]),
        ("PLEXRL_ROLLOUTS", ["plexrl.rollouts.>"]),
    ):
        await old.js.add_stream(api.StreamConfig(name=name, subjects=subjects))
    await old.js.create_key_value(api.KeyValueConfig(bucket="plexrl-progress", history=5))
    await old.js.create_object_store("plexrl-weights")
    await old.js.create_object_store("plexrl-weights-acme")
    submitted = RunSubmitted(run_id=RUN, config={"env": "reverse"})
    await old.publish("plexrl.runs.submit", submitted)
    await old.publish(rollouts_subject(RUN), _batch(0))
    await old.close()

    _set_env(
        monkeypatch,
        {
            "PLEXRL_RUNS_MAX_BYTES": "3MiB",
            "PLEXRL_ROLLOUTS_MAX_BYTES": "5MiB",
            "PLEXRL_ROLLOUTS_MAX_AGE_S": "3600",
            "PLEXRL_KV_MAX_BYTES": "1MiB",
            "PLEXRL_WEIGHTS_STORE_MAX_BYTES": "7MiB",
            "PLEXRL_TENANT_WEIGHTS_STORE_MAX_BYTES": "2MiB",
        },
    )
    bus = await Bus.connect(server.url, "test")
    try:
        runs = (await bus.js.stream_info("PLEXRL_RUNS")).config
        assert (runs.max_bytes, runs.discard) == (3 * MiB, api.DiscardPolicy.NEW)
        rollouts = (await bus.js.stream_info("PLEXRL_ROLLOUTS")).config
        assert (rollouts.max_bytes, rollouts.max_age) == (5 * MiB, 3600.0)
        assert (await bus.js.stream_info("KV_plexrl-progress")).config.max_bytes == MiB
        assert (await bus.js.stream_info("OBJ_plexrl-weights")).config.max_bytes == 7 * MiB
        assert (await bus.js.stream_info("OBJ_plexrl-weights-acme")).config.max_bytes == 2 * MiB
        # Nothing was lost, and the old messages still decode.
        msg = await bus.js.get_last_msg("PLEXRL_RUNS", "plexrl.runs.submit")
        assert decode(msg.data or b"", RunSubmitted) == submitted
        msg = await bus.js.get_last_msg("PLEXRL_ROLLOUTS", rollouts_subject(RUN))
        assert decode(msg.data or b"", RolloutBatch) == _batch(0)
        assert await provision(bus.js) == []
    finally:
        await bus.close()


async def test_a_limit_below_what_a_stream_holds_waits_until_it_holds_less(
    server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bus = await Bus.connect(server.url, "test")
    try:
        for step in range(20):
            await bus.publish(rollouts_subject(RUN), _batch(step, tokens=200))
        held = (await bus.js.stream_info("PLEXRL_ROLLOUTS")).state.bytes
        smaller = process_settings({"PLEXRL_ROLLOUTS_MAX_BYTES": str(held // 2)})
        assert await provision(bus.js, settings=smaller) == []
        assert (await bus.js.stream_info("PLEXRL_ROLLOUTS")).config.max_bytes == 2048 * MiB
        assert f"more than PLEXRL_ROLLOUTS_MAX_BYTES={held // 2}" in caplog.text
        await bus.js.purge_stream("PLEXRL_ROLLOUTS")
        assert await provision(bus.js, settings=smaller) == ["updated stream PLEXRL_ROLLOUTS"]
        assert (await bus.js.stream_info("PLEXRL_ROLLOUTS")).config.max_bytes == held // 2
    finally:
        await bus.close()


async def test_a_full_stream_pauses_the_publisher_and_it_resumes_when_space_returns(
    server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PLEXRL_ROLLOUTS_MAX_BYTES", "8KiB")
    caplog.set_level(logging.WARNING, logger="services.bus.limits")
    bus = await Bus.connect(server.url, "orchestrator")
    subject = rollouts_subject(RUN)
    trainer = await bus.js.pull_subscribe("plexrl.rollouts.>", "trainer", "PLEXRL_ROLLOUTS")
    try:
        full_at = await _fill(
            lambda i: bus.publish(subject, _batch(i), msg_id=f"{RUN}/step_{i}", full_wait=0)
        )
        assert full_at > 0
        with pytest.raises(StorageFull) as refused:
            await bus.publish(subject, _batch(full_at), full_wait=0)
        error = refused.value
        assert (error.where, error.setting, error.server) == (
            "stream PLEXRL_ROLLOUTS",
            "PLEXRL_ROLLOUTS_MAX_BYTES",
            False,
        )
        assert "maximum bytes exceeded" in str(error)
        assert f"RolloutBatch to {subject}" in str(error)
        assert "the trainer frees space as it commits" in str(error)

        # Without a time limit the publisher waits, and says so.
        waiting = asyncio.create_task(
            bus.publish(subject, _batch(full_at), msg_id=f"{RUN}/step_{full_at}")
        )
        await _eventually(_paused(caplog))
        assert not waiting.done()
        assert "stream PLEXRL_ROLLOUTS is full" in caplog.text

        # The trainer commits what it trained: acknowledged, purged, the newest one kept.
        trained = await trainer.fetch(full_at, timeout=5.0)
        for msg in trained:
            await msg.ack_sync()
        newest = trained[-1].metadata.sequence.stream
        await purge_consumed(bus.js, "PLEXRL_ROLLOUTS", subject, newest)
        ack = await asyncio.wait_for(waiting, 10.0)
        assert not ack.duplicate
        assert any("resumed" in r.getMessage() for r in caplog.records)
        state = (await bus.js.stream_info("PLEXRL_ROLLOUTS")).state
        assert state.messages == 2  # the newest trained batch and the one that waited
        last = await bus.js.get_last_msg("PLEXRL_ROLLOUTS", subject)
        assert decode(last.data or b"", RolloutBatch).step == full_at
        assert last.seq == ack.seq
    finally:
        await bus.close()


async def test_raising_the_limit_resumes_a_paused_publisher(
    server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PLEXRL_RUNS_MAX_BYTES", "4KiB")
    caplog.set_level(logging.WARNING, logger="services.bus.limits")
    bus = await Bus.connect(server.url, "registry")
    try:
        event = RunSubmitted(run_id=RUN, config={"pad": "x" * 300})
        full_at = await _fill(
            lambda i: bus.publish("plexrl.runs.submit", event, msg_id=f"s{i}", full_wait=0)
        )
        waiting = asyncio.create_task(
            bus.publish("plexrl.runs.submit", event, msg_id=f"s{full_at}")
        )
        await _eventually(_paused(caplog))
        assert "Raise PLEXRL_RUNS_MAX_BYTES" in caplog.text
        # The operator raises the limit; the next service start (or this call) applies it.
        monkeypatch.setenv("PLEXRL_RUNS_MAX_BYTES", "1MiB")
        assert await provision(bus.js) == ["updated stream PLEXRL_RUNS"]
        await asyncio.wait_for(waiting, 10.0)
        state = (await bus.js.stream_info("PLEXRL_RUNS")).state
        assert state.messages == full_at + 1  # every event stored once, none dropped
    finally:
        await bus.close()


async def test_a_full_server_store_pauses_every_writer_until_space_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _set_env(monkeypatch, UNLIMITED)  # no reservations: the server's own store is the limit
    caplog.set_level(logging.WARNING, logger="services.bus.limits")
    with EmbeddedNats(store_dir=tmp_path / "nats", max_file_store=MiB) as server:
        bus = await Bus.connect(server.url, "orchestrator")
        subject = rollouts_subject(RUN)
        try:
            full_at = await _fill(
                lambda i: bus.publish(subject, _batch(i, tokens=2000), full_wait=0)
            )
            with pytest.raises(StorageFull) as refused:
                await bus.publish(subject, _batch(full_at), full_wait=0)
            assert refused.value.server
            assert "insufficient resources" in str(refused.value)
            assert "max_file_store" in str(refused.value)
            # A progress write waits as well, instead of failing the trainer.
            progress = Progress(step=3, total_tokens=30, total_samples=3)
            writing = asyncio.create_task(write_progress(bus, RUN, progress))
            await _eventually(_paused(caplog))
            assert not writing.done()
            await bus.js.purge_stream("PLEXRL_ROLLOUTS")
            await asyncio.wait_for(writing, 10.0)
            stored = await read_progress(bus, RUN)
            assert stored is not None and stored.step == 3
        finally:
            await bus.close()


async def test_a_full_kv_bucket_pauses_progress_writes_until_the_limit_is_raised(
    server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PLEXRL_KV_MAX_BYTES", "4KiB")
    caplog.set_level(logging.WARNING, logger="services.bus.limits")
    bus = await Bus.connect(server.url, "trainer")
    try:
        kv = await bus.js.key_value("plexrl-progress")

        async def put(i: int) -> None:
            try:
                await kv.put(f"run_other_{i}", b"x")
            except Exception as exc:
                raise StorageFull(str(exc), where="") from exc

        await _fill(put)
        progress = Progress(step=1, total_tokens=10, total_samples=1)
        writing = asyncio.create_task(write_progress(bus, RUN, progress))
        await _eventually(_paused(caplog))
        assert "KV bucket plexrl-progress is full" in caplog.text
        assert "Raise PLEXRL_KV_MAX_BYTES" in caplog.text
        monkeypatch.setenv("PLEXRL_KV_MAX_BYTES", "1MiB")
        assert await provision(bus.js) == [
            "updated bucket plexrl-registry",
            "updated bucket plexrl-progress",
        ]
        await asyncio.wait_for(writing, 10.0)
        stored = await read_progress(bus, RUN)
        assert stored is not None and stored.step == 1
    finally:
        await bus.close()


async def test_error_reports_give_way_to_newer_ones_and_never_wait(
    server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLEXRL_ERRORS_MAX_BYTES", "4KiB")
    bus = await Bus.connect(server.url, "svc")
    try:
        for i in range(40):
            await asyncio.wait_for(bus.report_error(f"failure {i} " + "y" * 200), 5.0)
        state = (await bus.js.stream_info("PLEXRL_ERRORS")).state
        assert state.bytes <= 4096
        assert 0 < state.messages < 40
        last = await bus.js.get_last_msg("PLEXRL_ERRORS", "plexrl.errors.svc")
        assert decode(last.data or b"", ServiceError).error.startswith("failure 39 ")
    finally:
        await bus.close()


async def test_limits_the_server_cannot_reserve_are_a_clear_error_at_start_up(
    tmp_path: Path,
) -> None:
    with (
        EmbeddedNats(store_dir=tmp_path / "nats", max_file_store=64 * MiB) as server,
        pytest.raises(StorageFull) as refused,
    ):
        await Bus.connect(server.url, "test")
    message = str(refused.value)
    assert refused.value.setting == "PLEXRL_RUNS_MAX_BYTES"
    assert "stream PLEXRL_RUNS" in message
    assert "max_file_store" in message
    assert "Lower PLEXRL_RUNS_MAX_BYTES" in message


async def test_an_event_over_max_payload_is_refused_before_the_wire(tmp_path: Path) -> None:
    with EmbeddedNats(store_dir=tmp_path / "nats", max_payload=MiB) as server:
        bus = await Bus.connect(server.url, "orchestrator")
        try:
            assert bus.nc.max_payload == MiB
            huge = _batch(0, tokens=200_000)
            with pytest.raises(PayloadTooLarge) as refused:
                await bus.publish(rollouts_subject(RUN), huge)
            message = str(refused.value)
            assert f"RolloutBatch for {rollouts_subject(RUN)}" in message
            assert f"max_payload of {MiB} bytes" in message
            assert "batch_size, group_size or sampling.max_tokens" in message
            assert (await bus.js.stream_info("PLEXRL_ROLLOUTS")).state.messages == 0
            # Weights are split into chunks no bigger than the server takes.
            blob = bytes(range(256)) * (10 * 1024)  # 2.5 MiB
            await write_blob(bus, "run_big/step_1", blob)
            assert await get_blob(bus, "run_big/step_1") == blob
            chunks = await bus.js.stream_info("OBJ_plexrl-weights")
            assert chunks.state.messages == 3 + 1  # three chunks of at most 1 MiB, one description
        finally:
            await bus.close()


async def _steps_left(bus: Bus, subject: str) -> list[int]:
    """The steps of the batches still stored on ``subject``."""
    state = (await bus.js.stream_info("PLEXRL_ROLLOUTS")).state
    steps = []
    for seq in range(state.first_seq, state.last_seq + 1):
        try:
            msg = await bus.js.get_msg("PLEXRL_ROLLOUTS", seq)
        except NotFoundError:
            continue  # purged
        if msg.subject == subject:
            steps.append(decode(msg.data or b"", RolloutBatch).step)
    return steps


async def test_only_what_every_consumer_acknowledged_is_purged(server: EmbeddedNats) -> None:
    bus = await Bus.connect(server.url, "trainer")
    subject, other = rollouts_subject(RUN), rollouts_subject("run_other")
    try:
        for step in range(5):  # stream sequences 1 to 5
            await bus.publish(subject, _batch(step))
        await bus.publish(other, _batch(0))
        trainer = await bus.js.pull_subscribe("plexrl.rollouts.>", "trainer", "PLEXRL_ROLLOUTS")
        received = await trainer.fetch(6, timeout=5.0)
        # Steps 0, 1, 3 and 4 are committed; step 2 still waits for its checkpoint.
        waiting = []
        for msg in received:
            if msg.subject != subject:
                continue
            if decode(msg.data, RolloutBatch).step == 2:
                waiting.append(msg)
            else:
                await msg.ack_sync()
        await purge_consumed(bus.js, "PLEXRL_ROLLOUTS", subject, newest=5)
        assert await _steps_left(bus, subject) == [2, 3, 4]

        await waiting[0].ack_sync()
        # A second durable consumer that has acknowledged nothing holds everything back.
        await bus.js.pull_subscribe("plexrl.rollouts.>", "audit", "PLEXRL_ROLLOUTS")
        await purge_consumed(bus.js, "PLEXRL_ROLLOUTS", subject, newest=5)
        assert await _steps_left(bus, subject) == [2, 3, 4]
        await bus.js.delete_consumer("PLEXRL_ROLLOUTS", "audit")
        await purge_consumed(bus.js, "PLEXRL_ROLLOUTS", subject, newest=5)
        assert await _steps_left(bus, subject) == [4]  # the newest committed batch stays
        assert await _steps_left(bus, other) == [0]  # purged per run, never another run's
    finally:
        await bus.close()


def test_commands_say_which_limit_stops_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "orch.toml"
    config.write_text('env = "reverse"\nmax_steps = 2\n')
    with EmbeddedNats(store_dir=tmp_path / "nats", max_file_store=64 * MiB) as server:
        # A service whose limits the server cannot reserve stops at once, saying which.
        status = main(["registry", "--output-dir", str(tmp_path), "--nats-url", server.url])
        assert status == 1
        err = capsys.readouterr().err
        assert "plexrl registry: cannot give stream PLEXRL_RUNS a limit" in err
        assert "Lower PLEXRL_RUNS_MAX_BYTES" in err
        # A client publishing to a full stream is told so at once instead of waiting.
        _set_env(monkeypatch, UNLIMITED | {"PLEXRL_RUNS_MAX_BYTES": "200"})
        assert main(["submit", RUN, str(config), "--nats-url", server.url]) == 1
        err = capsys.readouterr().err
        assert "plexrl submit: stream PLEXRL_RUNS is full (maximum bytes exceeded)" in err
        assert "Raise PLEXRL_RUNS_MAX_BYTES" in err


async def test_a_stop_request_ends_a_paused_publish_with_stopped_waiting(
    server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A service asked to stop (SIGTERM sets ``bus.stopping``) while a write waits for room
    leaves the write undone and says so, instead of waiting for room that may never come."""
    monkeypatch.setenv("PLEXRL_ROLLOUTS_MAX_BYTES", "8KiB")
    caplog.set_level(logging.WARNING, logger="services.bus")
    bus = await Bus.connect(server.url, "orchestrator")
    bus.stopping = asyncio.Event()
    subject = rollouts_subject(RUN)
    try:
        full_at = await _fill(
            lambda i: bus.publish(subject, _batch(i), msg_id=f"{RUN}/step_{i}", full_wait=0)
        )
        waiting = asyncio.create_task(
            bus.publish(subject, _batch(full_at), msg_id=f"{RUN}/step_{full_at}")
        )
        await _eventually(_paused(caplog))
        assert not waiting.done()
        bus.stopping.set()
        with pytest.raises(StoppedWaiting, match=r"asked to stop after waiting .* for room"):
            await asyncio.wait_for(waiting, 5.0)
        assert "maximum bytes exceeded" in caplog.text
        state = (await bus.js.stream_info("PLEXRL_ROLLOUTS")).state
        assert state.messages == full_at  # nothing half-written
    finally:
        await bus.close()
