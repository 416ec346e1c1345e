"""``plexrl submit``, ``plexrl evict`` and ``plexrl runs``: the registry's clients.

``submit`` checks the run id and the config locally first (a clear message and exit status 2
for a mistake), then publishes RunSubmitted; with ``--wait`` it also waits for the registry's
answer. ``evict`` publishes EvictRequested. ``runs`` prints the run table from KV
``plexrl-registry`` joined with the progress in KV ``plexrl-progress``.

Every command exits with status 1 and says where it looked when NATS cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from services.config import add_common_args


def register(subparsers: Any) -> None:
    submit = subparsers.add_parser(
        "submit",
        help="ask the registry for a run (publish RunSubmitted)",
        description="Check RUN_ID and CONFIG.toml locally, then publish a RunSubmitted event.",
    )
    submit.add_argument("run_id", metavar="RUN_ID", help="'run_' + 1-64 letters, digits, _ or -")
    submit.add_argument("config", type=Path, metavar="CONFIG.toml", help="the run's orch.toml")
    submit.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to SECONDS for the registry to accept or reject the run",
    )
    add_common_args(submit, config=False)
    submit.set_defaults(func=_submit)

    evict = subparsers.add_parser(
        "evict",
        help="ask the registry to evict a run (publish EvictRequested)",
        description="Publish an EvictRequested event; the registry writes control/evicted.txt.",
    )
    evict.add_argument("run_id", metavar="RUN_ID")
    evict.add_argument("--reason", required=True, help="why (written to control/evicted.txt)")
    add_common_args(evict, config=False)
    evict.set_defaults(func=_evict)

    runs = subparsers.add_parser(
        "runs",
        help="show the run table: id, index, status, step, tokens, samples",
        description="The registry's run table (KV plexrl-registry) with each run's progress.",
    )
    runs.add_argument("--all", action="store_true", help="include forgotten runs")
    runs.add_argument("--json", action="store_true", help="one JSON object per line")
    runs.add_argument(
        "--sweep",
        metavar="NAME",
        help="only the runs of sweep NAME (run_NAME and run_NAME-...)",
    )
    add_common_args(runs, config=False)
    runs.set_defaults(func=lambda args: _connected(args, lambda bus: _runs(bus, args)))


def _connected(args: argparse.Namespace, body: Callable[[Any], Awaitable[int]]) -> int:
    """``body(bus)`` on a connection to ``--nats-url``; status 1 when nothing listens there."""
    from services.config import SettingsError, nats_url
    from services.launch import fail, run_client

    try:
        url = nats_url(args)
    except SettingsError as exc:
        return fail(args.command, exc)
    return run_client(args.command, body, nats_url=url)


# --- submit -----------------------------------------------------------------------------------


def _submit(args: argparse.Namespace) -> int:
    from schemas.config import ConfigError, load_orch_config
    from schemas.run_id import InvalidRunId, validate_run_id

    try:
        run_id = validate_run_id(args.run_id)
        config = load_orch_config(args.config)
    except (InvalidRunId, ConfigError) as exc:
        print(f"plexrl submit: {exc}", file=sys.stderr)
        return 2
    return _connected(args, lambda bus: _publish_submit(bus, run_id, config, args.wait))


async def _publish_submit(bus: Any, run_id: str, config: Any, wait: float) -> int:
    from schemas import subjects as sj
    from schemas.events import RunSubmitted

    digest = config.digest()
    answers: asyncio.Queue[Any] = asyncio.Queue()
    subs = []
    if wait > 0:  # subscribe before publishing, so no answer can slip past
        for subject in (sj.INVALID, "plexrl.errors.>"):
            subs.append(await bus.nc.subscribe(subject, cb=answers.put))
    event = RunSubmitted(
        run_id=run_id,
        config=config.to_dict(),
        submitted_by=f"plexrl submit ({getpass.getuser()}@{socket.gethostname()})",
    )
    ack = await bus.publish(sj.SUBMIT, event, msg_id=f"{run_id}/submit/{uuid.uuid4().hex}")
    print(f"submitted {run_id} (config {digest}, stream sequence {ack.seq})")
    if wait > 0:
        return await _await_answer(bus, run_id, digest, answers, wait)
    print("follow it with `plexrl runs`")
    return 0


async def _await_answer(
    bus: Any, run_id: str, digest: str, answers: asyncio.Queue[Any], wait: float
) -> int:
    """Poll the run table and watch for a rejection until the registry has answered."""
    from schemas.codec import DecodeError, decode
    from schemas.events import RunConfigInvalid, ServiceError
    from services.runs.table import read_record

    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            rec = await read_record(bus, run_id)
        except Exception:  # unreadable, or the connection briefly away
            rec = None
        if rec is not None and rec.config_digest == digest:
            if rec.status == "active":
                print(f"{run_id} is running with index {rec.idx}")
                return 0
            if rec.status == "waiting":
                print(f"{run_id} is waiting for a free index")
                return 0
        while not answers.empty():
            msg = answers.get_nowait()
            try:
                ev: Any = decode(msg.data, RunConfigInvalid | ServiceError)
            except DecodeError:
                continue
            if ev.run_id == run_id:
                print(f"plexrl submit: the registry rejected {run_id}: {ev.error}", file=sys.stderr)
                return 1
        await asyncio.sleep(0.1)
    print(f"plexrl submit: no answer about {run_id} within {wait}s; is a registry running?")
    return 1


# --- evict ------------------------------------------------------------------------------------


def _evict(args: argparse.Namespace) -> int:
    from schemas.run_id import InvalidRunId, validate_run_id

    try:
        run_id = validate_run_id(args.run_id)
    except InvalidRunId as exc:
        print(f"plexrl evict: {exc}", file=sys.stderr)
        return 2
    return _connected(args, lambda bus: _publish_evict(bus, run_id, args.reason))


async def _publish_evict(bus: Any, run_id: str, reason: str) -> int:
    from schemas import subjects as sj
    from schemas.events import EvictRequested
    from services.runs.table import read_table

    records = await read_table(await bus.js.key_value(sj.KV_REGISTRY))
    event = EvictRequested(run_id=run_id, reason=reason[:16000], requested_by="plexrl evict")
    await bus.publish(sj.EVICT, event, msg_id=f"{run_id}/evict/{uuid.uuid4().hex}")
    print(f"asked the registry to evict {run_id}: {reason}")
    record = records.get(run_id)
    if record is None or record.status in ("evicted", "forgotten"):
        # sent anyway: the registry may find the directory the table does not list yet
        state = record.status if record else "not in the run table"
        print(f"note: {run_id} is {state}; see `plexrl runs`", file=sys.stderr)
    return 0


# --- runs -------------------------------------------------------------------------------------

_ORDER = {"active": 0, "waiting": 1, "invalid": 2, "evicted": 3, "forgotten": 4}


async def _runs(bus: Any, args: argparse.Namespace) -> int:
    from schemas.run_id import in_sweep
    from schemas.subjects import KV_REGISTRY
    from services.runs.progress import read_progress
    from services.runs.table import read_table

    records = await read_table(await bus.js.key_value(KV_REGISTRY))
    shown = [r for r in records.values() if args.all or r.status != "forgotten"]
    if args.sweep:
        shown = [r for r in shown if in_sweep(r.run_id, args.sweep)]
    shown.sort(key=lambda r: (_ORDER.get(r.status, 9), -1 if r.idx is None else r.idx, r.run_id))
    rows = []
    for rec in shown:
        progress = await read_progress(bus, rec.run_id)
        row: dict[str, Any] = {"run_id": rec.run_id, "idx": rec.idx, "status": rec.status}
        for key in ("step", "total_tokens", "total_samples", "reward_mean"):
            row[key] = getattr(progress, key) if progress else None
        rows.append(row | {"detail": rec.error or rec.reason})
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    _print_table(rows, f"sweep {args.sweep}" if args.sweep else "plexrl runs")
    return 0


def _print_table(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(v: Any, fmt: str = "{}") -> str:
        return "-" if v is None else fmt.format(v)

    table = Table(title=f"{title} ({len(rows)})")
    for name in ("id", "idx", "status", "step", "tokens", "samples", "reward", "detail"):
        table.add_column(name, justify="right" if name in ("idx", "step", "tokens") else "left")
    for r in rows:
        table.add_row(
            r["run_id"],
            cell(r["idx"]),
            r["status"],
            cell(r["step"]),
            cell(r["total_tokens"], "{:,}"),
            cell(r["total_samples"], "{:,}"),
            cell(r["reward_mean"], "{:.3f}"),
            (r["detail"] or "")[:60],
        )
    Console().print(table)
