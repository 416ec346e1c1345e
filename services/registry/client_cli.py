"""``plexrl submit``, ``plexrl evict`` and ``plexrl runs``: the registry's clients.

``submit`` checks the run id and the config locally first (a clear message and exit status 2
for a mistake), then publishes RunSubmitted; with ``--wait`` it also waits for the registry's
answer. With accounts the registry answers a tenant's submit or evict itself: a refusal is the
publish's error, printed with exit status 1. ``evict`` publishes EvictRequested (``--delete``:
also delete an evicted run's directory, freeing its id and the tenant's ``max_run_dirs``). ``runs`` prints the run table from KV
``plexrl-registry`` joined with the progress in KV ``plexrl-progress``.

Each command acts for the tenant of ``PLEXRL_TENANT`` (default ``default``): ``submit`` and
``evict`` publish on that tenant's subjects (``plexrl.runs.<tenant>.submit``...), and a tenant
other than the default, whose credentials cannot read the KV buckets, reads its runs through the
registry's list service (``plexrl.registry.<tenant>.list``) instead.

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
    evict.add_argument("--reason", default="", help="why (written to control/evicted.txt)")
    evict.add_argument(
        "--delete",
        action="store_true",
        help="delete the directory of a run already evicted or invalid (its checkpoints too): "
        "the run is forgotten and its id free again",
    )
    add_common_args(evict, config=False)
    evict.set_defaults(func=_evict)

    runs = subparsers.add_parser(
        "runs",
        help="show the run table: id, tenant, index, status, step, tokens, samples",
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


def _tenant() -> str:
    from services.config import process_settings

    return process_settings().tenant


async def _publish_submit(bus: Any, run_id: str, config: Any, wait: float) -> int:
    from schemas import subjects as sj
    from schemas.events import RunSubmitted
    from schemas.tenant import DEFAULT_TENANT

    tenant = _tenant()
    digest = config.digest()
    answers: asyncio.Queue[Any] = asyncio.Queue()
    if wait > 0:  # subscribe before publishing, so no answer can slip past
        watched = [sj.runs_subject("invalid", tenant)]
        if tenant == DEFAULT_TENANT:  # a tenant's credentials may not read the error reports
            watched.append("plexrl.errors.>")
        for subject in watched:
            await bus.nc.subscribe(subject, cb=answers.put)
    event = RunSubmitted(
        run_id=run_id,
        config=config.to_dict(),
        submitted_by=f"plexrl submit ({getpass.getuser()}@{socket.gethostname()})",
    )
    subject = sj.runs_subject("submit", tenant)
    # a full PLEXRL_RUNS is an error at once (exit 1, saying which limit), not a silent wait
    ack = await _refused_or(
        "submit",
        bus.publish(subject, event, msg_id=f"{run_id}/submit/{uuid.uuid4().hex}", full_wait=0),
    )
    if ack is None:
        return 1
    if ack.duplicate and not ack.seq:
        print(f"{run_id} is already held with this config (config {digest})")
    else:
        print(f"submitted {run_id} (config {digest}, stream sequence {ack.seq})")
    if wait > 0:
        return await _await_answer(bus, run_id, digest, answers, wait, tenant)
    print("follow it with `plexrl runs`")
    return 0


async def _record_of(bus: Any, run_id: str, tenant: str) -> Any:
    """``run_id``'s record (KV) or, for a tenant, its row from the list service; or None."""
    from schemas.tenant import DEFAULT_TENANT
    from services.runs.table import list_runs, read_record

    if tenant == DEFAULT_TENANT:
        return await read_record(bus, run_id)
    return next((r for r in await list_runs(bus, tenant) if r.run_id == run_id), None)


async def _await_answer(
    bus: Any, run_id: str, digest: str, answers: asyncio.Queue[Any], wait: float, tenant: str
) -> int:
    """Poll the run table and watch for a rejection until the registry has answered."""
    from schemas.codec import DecodeError, decode
    from schemas.events import RunConfigInvalid, ServiceError
    from schemas.records import HOLDING_STATUSES

    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            rec = await _record_of(bus, run_id, tenant)
        except Exception:  # unreadable, no registry answering yet, or the connection away
            rec = None
        if rec is not None and rec.status in HOLDING_STATUSES:
            # A row from a registry older than RunRow.config_digest carries none: then the
            # registry's refusal of this submit is what tells a conflict.
            if rec.config_digest and rec.config_digest != digest:
                print(
                    f"plexrl submit: {run_id} already exists with a different config (registry: "
                    f"{rec.config_digest}, given: {digest}); evict it or choose another run id",
                    file=sys.stderr,
                )
                return 1
            if rec.status == "active":
                print(f"{run_id} is running with index {rec.idx}")
            else:
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
    if not args.reason and not args.delete:
        print("plexrl evict: say why with --reason (or --delete an evicted run)", file=sys.stderr)
        return 2
    return _connected(args, lambda bus: _publish_evict(bus, run_id, args.reason, args.delete))


async def _refused_or(command: str, publish: Awaitable[Any]) -> Any:
    """The acknowledgement of ``publish``, or None after printing the registry's refusal."""
    from nats.js.errors import APIError

    try:
        return await publish
    except APIError as exc:
        print(f"plexrl {command}: refused: {exc.description}", file=sys.stderr)
        return None


async def _publish_evict(bus: Any, run_id: str, reason: str, delete: bool = False) -> int:
    from schemas import subjects as sj
    from schemas.events import EvictRequested

    tenant = _tenant()
    try:
        record = await _record_of(bus, run_id, tenant)
    except Exception as exc:  # only the note below needs it: the request goes out anyway
        print(f"note: cannot read {run_id}'s status ({exc})", file=sys.stderr)
        record = None
    event = EvictRequested(
        run_id=run_id,
        reason=reason[:16000] or "deleted",
        requested_by="plexrl evict",
        delete=delete,
    )
    subject = sj.runs_subject("evict", tenant)
    ack = await _refused_or(
        "evict",
        bus.publish(subject, event, msg_id=f"{run_id}/evict/{uuid.uuid4().hex}", full_wait=0),
    )
    if ack is None:
        return 1
    if delete:
        print(f"asked the registry to delete {run_id}")
        return 0
    print(f"asked the registry to evict {run_id}: {reason}")
    if record is None or record.status in ("evicted", "forgotten"):
        # sent anyway: the registry may find the directory the table does not list yet
        state = record.status if record else "not in the run table"
        print(f"note: {run_id} is {state}; see `plexrl runs`", file=sys.stderr)
    return 0


# --- runs -------------------------------------------------------------------------------------

_ORDER = {"active": 0, "waiting": 1, "invalid": 2, "evicted": 3, "forgotten": 4}


async def _runs(bus: Any, args: argparse.Namespace) -> int:
    from schemas.run_id import in_sweep
    from schemas.tenant import DEFAULT_TENANT

    tenant = _tenant()
    if tenant == DEFAULT_TENANT:
        rows = await _rows_from_kv(bus)
    else:
        try:
            rows = await _rows_from_registry(bus, tenant)
        except Exception as exc:  # no registry answered, or it answered with an error
            print(f"plexrl runs: {_list_failure(exc, tenant)}", file=sys.stderr)
            return 1
    rows = [r for r in rows if args.all or r["status"] != "forgotten"]
    if args.sweep:
        rows = [r for r in rows if in_sweep(r["run_id"], args.sweep)]
    rows.sort(key=lambda r: (_ORDER.get(r["status"], 9), _idx_key(r["idx"]), r["run_id"]))
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    _print_table(rows, f"sweep {args.sweep}" if args.sweep else "plexrl runs")
    return 0


def _idx_key(idx: int | None) -> int:
    return -1 if idx is None else idx


async def _rows_from_kv(bus: Any) -> list[dict[str, Any]]:
    """Every run: the table in KV plexrl-registry joined with KV plexrl-progress."""
    from schemas.subjects import KV_REGISTRY
    from services.runs.progress import read_progress
    from services.runs.table import read_table

    records = await read_table(await bus.js.key_value(KV_REGISTRY))
    rows = []
    for rec in records.values():
        progress = await read_progress(bus, rec.run_id)
        row: dict[str, Any] = {
            "run_id": rec.run_id,
            "tenant": rec.tenant,
            "idx": rec.idx,
            "status": rec.status,
        }
        for key in ("step", "total_tokens", "total_samples", "reward_mean"):
            row[key] = getattr(progress, key) if progress else None
        rows.append(row | {"detail": rec.error or rec.reason})
    return rows


def _list_failure(exc: Exception, tenant: str) -> str:
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from schemas.subjects import registry_list_subject

    if isinstance(exc, NoRespondersError | NatsTimeout | TimeoutError):
        return (
            f"no registry answered on {registry_list_subject(tenant)}: a tenant's runs are "
            "listed by the registry service, so start it (or check PLEXRL_NATS_URL)"
        )
    return str(exc)


async def _rows_from_registry(bus: Any, tenant: str) -> list[dict[str, Any]]:
    """``tenant``'s runs, as the registry's list service answers them."""
    from services.runs.table import list_runs

    keys = ("run_id", "tenant", "idx", "status", "step", "total_tokens", "total_samples")
    return [
        {k: getattr(r, k) for k in keys} | {"reward_mean": r.reward_mean, "detail": r.detail}
        for r in await list_runs(bus, tenant)
    ]


def _print_table(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(v: Any, fmt: str = "{}") -> str:
        return "-" if v is None else fmt.format(v)

    table = Table(title=f"{title} ({len(rows)})")
    for name in ("id", "tenant", "idx", "status", "step", "tokens", "samples", "reward", "detail"):
        table.add_column(name, justify="right" if name in ("idx", "step", "tokens") else "left")
    for r in rows:
        table.add_row(
            r["run_id"],
            r["tenant"],
            cell(r["idx"]),
            r["status"],
            cell(r["step"]),
            cell(r["total_tokens"], "{:,}"),
            cell(r["total_samples"], "{:,}"),
            cell(r["reward_mean"], "{:.3f}"),
            (r["detail"] or "")[:60],
        )
    Console().print(table)
