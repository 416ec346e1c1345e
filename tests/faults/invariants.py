"""What must hold after any scenario, read from what the system recorded.

Per run: the step log (``trainer_steps.jsonl``), the progress record and the newest checkpoint
all say that steps 0..N-1 were trained, each exactly once; the orchestrator's ``metrics.jsonl``
has every step once, with a policy lag within ``max_async_level``; the newest WeightsReady of
every weight version still stored names the digest and size of the stored bytes (hashed here
again); every inference replica loaded each run's versions in increasing order, never an older
one (a resumed trainer republishes versions a replica may already hold); the trainer holds no
unacknowledged batch, not even after a nats-server crash that forgot acks it had confirmed (the
trainer's consumer gets those back on the reconnect). After the stop: no process of the system
is left, and no port it listened on is still open.
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path

from schemas.codec import decode
from schemas.events import WeightsReady
from schemas.subjects import WEIGHTS_STREAM, weights_object_key, weights_subject
from services.bus import Bus
from services.trainer.checkpoint import complete_checkpoints, read_step_log
from services.weights.blobs import get_blob
from services.weights.digest import digest_of
from services.weights.listing import list_keys

from .harness import System, read_jsonl


async def check_recorded(system: System) -> None:
    """Every invariant that reads the bus or the run directories (the nats-server is up)."""
    assert system.bus is not None
    for run_id, config in system.runs.items():
        n = config.max_steps
        trained = [int(r["step"]) for r in read_step_log(system.out, run_id)]
        assert sorted(trained) == list(range(n)), f"{run_id}: step log {trained}"
        progress = await system.progress(run_id)
        assert progress is not None, f"{run_id}: no progress record"
        assert progress.step == n, f"{run_id}: progress {progress}"
        assert progress.total_samples == n * config.batch_size * config.group_size, progress
        checkpoints = [step for step, _ in complete_checkpoints(system.out, run_id)]
        assert checkpoints and checkpoints[-1] == n, f"{run_id}: checkpoints {checkpoints}"

        metrics = read_jsonl(system.out / run_id / "metrics.jsonl")
        assert [m["step"] for m in metrics] == list(range(n)), f"{run_id}: metrics {metrics}"
        lags = [m["policy_lag"] for m in metrics]
        assert all(0 <= lag <= config.max_async_level for lag in lags), f"{run_id}: lags {lags}"
        assert all(m["policy_lag"] == m["step"] - m["policy_version"] for m in metrics)

        await check_weights(system.bus, run_id, n)
    check_replica_versions(system)
    backlog = await system.trainer_backlog()
    assert backlog == (0, 0), f"the trainer's consumer holds {backlog} (unacked, undelivered)"


async def check_weights(bus: Bus, run_id: str, max_steps: int) -> None:
    """The newest announcement of each stored version matches the stored bytes; the final
    version is announced and stored."""
    newest: dict[int, WeightsReady] = {}
    for event in await _announcements(bus, run_id):
        newest[event.step] = event
    assert max_steps in newest, f"{run_id}: versions announced {sorted(newest)}"
    prefix = f"{run_id}/step_"
    stored = sorted(
        int(k.removeprefix(prefix)) for k in await list_keys(bus) if k.startswith(prefix)
    )
    assert max_steps in stored, f"{run_id}: versions stored {stored}"
    for step in stored:
        event = newest.get(step)
        assert event is not None, f"{run_id}: version {step} is stored but was never announced"
        assert event.location == weights_object_key(run_id, step)
        data = await get_blob(bus, event.location)
        assert len(data) == event.size_bytes, f"{run_id} step {step}: {len(data)} bytes"
        got = digest_of([data], event.digest.partition(":")[0])
        assert got == event.digest, f"{run_id} step {step}: stored {got}, announced {event.digest}"


async def _announcements(bus: Bus, run_id: str) -> list[WeightsReady]:
    info = await bus.js.stream_info(WEIGHTS_STREAM)
    subject, out = weights_subject(run_id), []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            raw = await bus.js.get_msg(WEIGHTS_STREAM, seq)
        except Exception:  # deleted by the per-subject limit
            continue
        if raw.subject == subject:
            out.append(decode(raw.data or b"", WeightsReady))
    return out


_LOADED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO services\.inference\.service: "
    r"(\S+): version (\d+) loaded$"
)


def replica_loads(log: Path) -> list[tuple[float, str, int]]:
    """``(time.time(), run_id, version)`` of each adapter version an inference replica's log
    (every process that wrote to it, in order) says it loaded."""
    loads = []
    for line in log.read_text(errors="replace").splitlines():
        if match := _LOADED.match(line):
            stamp, run_id, version = match.groups()
            when = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            loads.append((when, run_id, int(version)))
    return loads


def check_replica_versions(system: System) -> None:
    """Per replica and run, the versions loaded never go back and the newest is at most the
    run's last version; a restarted replica may load again the version it held."""
    for i in range(system.replicas):
        loads = replica_loads(system.procs[f"inference-{i}"].log)
        for run_id, config in system.runs.items():
            versions = [v for _, r, v in loads if r == run_id]
            assert versions == sorted(versions), f"inference-{i}, {run_id}: loaded {versions}"
            assert not versions or versions[-1] <= config.max_steps, (
                f"inference-{i}, {run_id}: {versions}"
            )


def listening_ports(pids: list[int]) -> set[int]:
    """TCP ports in LISTEN state held by any of ``pids`` (from /proc)."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return {port for port, inode in _listening() if inode in inodes}


def _listening() -> list[tuple[int, str]]:
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A":  # LISTEN
                found.append((int(cols[1].rsplit(":", 1)[1], 16), cols[9]))
    return found


def check_nothing_left(system: System, ports: set[int]) -> None:
    """No process whose command line names this system's directory, no port still listening."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(system.root) in cmdline:
            left.append(f"{entry.name}: {cmdline}")
    assert not left, f"processes left behind: {left}"
    still = {port for port, _ in _listening()} & ports
    assert not still, f"ports still listening: {sorted(still)}"
