"""The registry against a real nats-server: discovery, indices, forgetting, eviction, restarts."""

from __future__ import annotations

from pathlib import Path

from schemas import subjects as sj
from schemas.config import parse_orch_config
from schemas.events import (
    EvictRequested,
    RunDiscovered,
    RunEvicted,
    RunForgotten,
    RunSubmitted,
    ServiceError,
)
from services.bus import Bus

from .conftest import RegistryFactory
from .helpers import (
    VALID_TOML,
    error_reports,
    events_on,
    eventually,
    stop_registry,
    stream_messages,
    table,
    write_orch,
)


async def _discovered(bus: Bus) -> list[RunDiscovered]:
    return await events_on(bus, sj.DISCOVERED, RunDiscovered)


async def test_scan_discovers_a_run_directory(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    write_orch(out, "run_a")
    registry = await make_registry()
    expected = parse_orch_config(VALID_TOML)
    assert registry.idx_of("run_a") == 0 and registry.run_id_of(0) == "run_a"
    [event] = await _discovered(rbus)
    assert (event.run_id, event.idx) == ("run_a", 0)
    assert event.config == expected.to_dict()
    assert event.config_digest == expected.digest()
    record = (await table(rbus))["run_a"]
    assert (record.status, record.idx, record.config_digest) == ("active", 0, expected.digest())
    assert (
        record.last_published
        == f"run_a/discovered/{record.transition}/"
        + (expected.digest().removeprefix("sha256:")[:16])
    )


async def test_submit_and_scan_give_the_same_result(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    write_orch(out, "run_scanned")
    await make_registry()
    config = parse_orch_config(VALID_TOML)
    # a client sends only what it cares about; defaults are filled in by validation
    await rbus.publish(
        sj.SUBMIT, RunSubmitted(run_id="run_submitted", config={**config.model_dump(mode="json")})
    )
    events = await eventually(lambda: _wait_len(rbus, 2))
    by_id = {e.run_id: e for e in events}
    assert by_id["run_scanned"].config == by_id["run_submitted"].config == config.to_dict()
    assert by_id["run_scanned"].config_digest == by_id["run_submitted"].config_digest
    assert (by_id["run_scanned"].idx, by_id["run_submitted"].idx) == (0, 1)
    written = out / "run_submitted" / "control" / "orch.toml"
    assert parse_orch_config(written.read_text()).digest() == config.digest()
    assert not list(written.parent.glob("*.tmp"))  # the atomic write left nothing behind


async def _wait_len(bus: Bus, n: int) -> list[RunDiscovered]:
    events = await _discovered(bus)
    return events if len(events) >= n else []


async def test_lowest_free_index_is_reused_after_a_directory_disappears(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    for run_id in ("run_a", "run_b", "run_c"):
        write_orch(out, run_id)
    registry = await make_registry(max_runs=3)
    assert [registry.idx_of(r) for r in ("run_a", "run_b", "run_c")] == [0, 1, 2]
    # rmtree of a run directory
    for p in sorted((out / "run_b").rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    (out / "run_b").rmdir()
    await registry.scan()
    forgotten = await events_on(rbus, sj.FORGOTTEN, RunForgotten)
    assert [(e.run_id, e.idx) for e in forgotten] == [("run_b", 1)]
    assert registry.idx_of("run_b") is None
    assert (await table(rbus))["run_b"].status == "forgotten"
    write_orch(out, "run_d")
    await registry.scan()
    assert registry.idx_of("run_d") == 1
    await registry.scan()  # nothing changed: nothing new on the stream
    assert [(e.run_id, e.idx) for e in await _discovered(rbus)] == [
        ("run_a", 0),
        ("run_b", 1),
        ("run_c", 2),
        ("run_d", 1),
    ]


async def test_evicted_txt_is_never_discovered_and_evicts_a_running_run(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    write_orch(out, "run_old")
    (out / "run_old" / "control" / "evicted.txt").write_text("diverged last week\n")
    write_orch(out, "run_live")
    registry = await make_registry()
    assert registry.idx_of("run_old") is None and registry.idx_of("run_live") == 0
    # an operator (or a registry that crashed right after writing it) leaves evicted.txt
    (out / "run_live" / "control" / "evicted.txt").write_text("operator: out of budget\n")
    await registry.scan()
    [evicted] = await events_on(rbus, sj.EVICTED, RunEvicted)
    assert (evicted.run_id, evicted.idx, evicted.reason) == (
        "run_live",
        0,
        "operator: out of budget",
    )
    await registry.scan()
    assert [e.run_id for e in await _discovered(rbus)] == ["run_live"]
    assert "run_old" not in await table(rbus)


async def test_full_pool_waits_then_the_oldest_waiter_gets_the_freed_index(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    registry = await make_registry(max_runs=2)
    config = parse_orch_config(VALID_TOML).to_dict()
    for run_id in ("run_a", "run_b", "run_c", "run_d"):
        await rbus.publish(sj.SUBMIT, RunSubmitted(run_id=run_id, config=config))
    await eventually(lambda: _statuses(rbus, run_c="waiting", run_d="waiting"))
    assert (registry.idx_of("run_a"), registry.idx_of("run_b")) == (0, 1)
    assert registry.pool.waiting == ["run_c", "run_d"]  # not rejected: queued, oldest first

    await rbus.publish(
        sj.EVICT, EvictRequested(run_id="run_a", reason="bad data", requested_by="t")
    )
    await eventually(lambda: _statuses(rbus, run_a="evicted", run_c="active"))
    assert registry.idx_of("run_c") == 0 and registry.pool.waiting == ["run_d"]
    assert (out / "run_a" / "control" / "evicted.txt").read_text() == "bad data\n"

    await rbus.publish(sj.EVICT, EvictRequested(run_id="run_b", reason="diverged"))
    await eventually(lambda: _statuses(rbus, run_d="active"))
    assert registry.idx_of("run_d") == 1
    evicted = await events_on(rbus, sj.EVICTED, RunEvicted)
    assert [(e.run_id, e.idx, e.reason) for e in evicted] == [
        ("run_a", 0, "bad data"),
        ("run_b", 1, "diverged"),
    ]
    assert [(e.run_id, e.idx) for e in await _discovered(rbus)] == [
        ("run_a", 0),
        ("run_b", 1),
        ("run_c", 0),
        ("run_d", 1),
    ]


async def _statuses(bus: Bus, **want: str) -> bool:
    records = await table(bus)
    return all(r in records and records[r].status == s for r, s in want.items())


async def test_evicting_an_unknown_run_reports_and_changes_nothing(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    write_orch(out, "run_a")
    registry = await make_registry()
    before = await table(rbus)
    stream_before = await stream_messages(rbus)
    await rbus.publish(sj.EVICT, EvictRequested(run_id="run_nobody", reason="x", requested_by="t"))
    reports = await eventually(lambda: error_reports(rbus))
    [report] = reports
    assert isinstance(report, ServiceError) and report.run_id == "run_nobody"
    assert report.error.startswith("cannot evict run_nobody: no such run in this registry")
    assert "plexrl runs" in report.error
    assert await table(rbus) == before
    assert registry.idx_of("run_a") == 0
    assert not (out / "run_nobody").exists()
    assert not (out / "run_a" / "control" / "evicted.txt").exists()
    after = await stream_messages(rbus)
    assert [s for s, _ in after[len(stream_before) :]] == [sj.EVICT]  # only the request itself


async def test_duplicate_submit_is_a_no_op_and_a_different_config_is_refused(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    registry = await make_registry()
    config = parse_orch_config(VALID_TOML)
    other = parse_orch_config(VALID_TOML + "\n[optim]\nlr = 0.01\n")
    for cfg in (config, config, other):
        await rbus.publish(sj.SUBMIT, RunSubmitted(run_id="run_a", config=cfg.to_dict()))
    reports = await eventually(lambda: error_reports(rbus))
    assert [r.error for r in reports] == [
        f"run_a already exists with a different config (digest {config.digest()} vs "
        f"{other.digest()}); evict it or choose another run id"
    ]
    assert [e.run_id for e in await _discovered(rbus)] == ["run_a"]
    assert registry.idx_of("run_a") == 0
    on_disk = parse_orch_config((out / "run_a" / "control" / "orch.toml").read_text())
    assert on_disk.digest() == config.digest()  # the running run was left untouched


async def test_submit_of_an_evicted_run_is_refused(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    write_orch(out, "run_a")
    registry = await make_registry()
    assert await registry.evict("run_a", "bad data", requested_by="test")
    config = parse_orch_config(VALID_TOML).to_dict()
    await rbus.publish(sj.SUBMIT, RunSubmitted(run_id="run_a", config=config))
    [report] = await eventually(lambda: error_reports(rbus))
    assert report.error.startswith("run_a was evicted (bad data) and is never rediscovered")
    assert registry.idx_of("run_a") is None
    assert len(await _discovered(rbus)) == 1


async def test_restart_keeps_every_index_and_republishes_nothing(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    for run_id in ("run_a", "run_b", "run_c"):
        write_orch(out, run_id)
    first = await make_registry(max_runs=3)
    assert await first.evict("run_b", "diverged")
    write_orch(out, "run_d")
    await first.scan()
    indices = {r: first.idx_of(r) for r in ("run_a", "run_b", "run_c", "run_d")}
    assert indices == {"run_a": 0, "run_b": None, "run_c": 2, "run_d": 1}
    before = await stream_messages(rbus)
    await stop_registry(first)

    second = await make_registry(max_runs=3)
    await second.scan()
    assert {r: second.idx_of(r) for r in indices} == indices
    assert await stream_messages(rbus) == before


async def test_waiting_runs_that_break_or_vanish_leave_the_queue(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    for run_id in ("run_a", "run_b", "run_c"):
        write_orch(out, run_id)
    registry = await make_registry(max_runs=1)
    assert registry.pool.waiting == ["run_b", "run_c"]
    write_orch(out, "run_b", "batch_size = -3\n")
    (out / "run_c" / "control" / "orch.toml").unlink()
    (out / "run_c" / "control").rmdir()
    (out / "run_c").rmdir()
    await registry.scan()
    assert registry.pool.waiting == []
    records = await table(rbus)
    assert (records["run_b"].status, records["run_c"].status) == ("invalid", "forgotten")
    assert await events_on(rbus, sj.FORGOTTEN, RunForgotten) == []  # it never held an index
    assert await registry.evict("run_a", "make room")
    assert registry.pool.num_free == 1
    write_orch(out, "run_b")  # fixed: it gets the free index
    await registry.scan()
    assert registry.idx_of("run_b") == 0
    assert [(e.run_id, e.idx) for e in await _discovered(rbus)] == [("run_a", 0), ("run_b", 0)]


async def test_a_run_id_can_come_back_after_its_directory_was_deleted(
    make_registry: RegistryFactory, rbus: Bus, tmp_path: Path
) -> None:
    out = tmp_path / "created-later"  # the registry may start before output_dir exists
    registry = await make_registry(output_dir=out)
    config = parse_orch_config(VALID_TOML).to_dict()
    await rbus.publish(sj.SUBMIT, RunSubmitted(run_id="run_a", config=config))
    await eventually(lambda: _wait_len(rbus, 1))
    for p in sorted((out / "run_a").rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    (out / "run_a").rmdir()
    await registry.scan()
    # the same id and config again: a new incarnation, announced again (the message id
    # carries the transition, so the stream's deduplication does not swallow it)
    await rbus.publish(sj.SUBMIT, RunSubmitted(run_id="run_a", config=config))
    events = await eventually(lambda: _wait_len(rbus, 2))
    assert [(e.run_id, e.idx) for e in events] == [("run_a", 0), ("run_a", 0)]
    forgotten = await events_on(rbus, sj.FORGOTTEN, RunForgotten)
    assert [(e.run_id, e.idx) for e in forgotten] == [("run_a", 0)]
    record = (await table(rbus))["run_a"]
    assert (record.status, record.transition) == ("active", 5)  # waiting, active, forgotten, ...
