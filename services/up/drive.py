"""One orchestrator per run in this process, against services already running.

``plexrl up`` calls :func:`drive_runs` once its services answer; ``plexrl sweep`` calls it
against a deployment someone else started. Runs beyond the registry's ``max_runs`` wait in its
queue: their orchestrators block in admission until an index frees up. With a sweep's early-stop
rule, the runs it judges worst are evicted on the way (:mod:`services.up.halving`).

The registry frees an index only when its run is evicted or its directory deleted, never when
the run has trained its last step; so for a sweep (``release_finished``) the driver asks the
registry to evict each run whose orchestrator is done, with the reason ``finished ...``, and
the index goes to the next waiting run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from services.bus import Bus
from services.up.halving import Halving, active_runs, request_evictions
from services.up.sweep import EarlyStop, SweepRun
from services.up.view import RunView, live_table


@dataclass
class Driven:
    views: list[RunView]
    results: list[Any]
    """one OrchestratorResult per run, in order"""
    early_stopped: dict[str, str]
    """run id -> reason, for the runs the sweep's early-stop rule evicted"""

    @property
    def exit_code(self) -> int:
        """The worst exit status of a run, not counting runs the early-stop rule evicted."""
        codes = [r.exit_code for r in self.results if r.run_id not in self.early_stopped]
        return max(codes, default=0)


async def drive_runs(
    bus: Bus,
    planned: list[SweepRun],
    *,
    output_dir: Path,
    tokenizer: Any,
    stop: asyncio.Event,
    console: Console,
    live: bool,
    title: str,
    submitted_by: str,
    check: Callable[[], None] = lambda: None,
    services: Callable[[], str | None] = lambda: None,
    early_stop: EarlyStop | None = None,
    release_finished: bool = False,
) -> Driven:
    """Start every run's orchestrator and watch them to the end; ``check`` raises to abort,
    ``services`` says what happened to the services (the live table's caption)."""
    from services.orchestrator.run_loop import RunOrchestrator

    # A run of its own stop each, so that the driver ends the runs its early-stop rule evicts
    # itself, whenever their orchestrators hear of the eviction; a global stop sets them all.
    stops = {run.run_id: asyncio.Event() for run in planned}

    async def forward_stop() -> None:
        await stop.wait()
        for event in stops.values():
            event.set()

    forwarder = asyncio.create_task(forward_stop())
    views, tasks = [], []
    for run in planned:
        orch = RunOrchestrator(
            bus,
            run.run_id,
            run.config,
            output_dir=output_dir,
            tokenizer=tokenizer,
            submitted_by=submitted_by,
        )
        views.append(RunView(run.run_id, run.config.env, run.config.max_steps, orch.metrics_path))
        tasks.append(asyncio.create_task(orch.run(stops[run.run_id]), name=run.run_id))
    halving = Halving(early_stop) if early_stop is not None else None
    released: set[str] = set()

    async def judge() -> None:
        done = {
            v.run_id: v.max_steps
            for v, t in zip(views, tasks, strict=True)
            if t.done()
            and not t.cancelled()
            and t.exception() is None
            and t.result().status == "done"
        }
        if release_finished and done.keys() - released:
            reasons = {
                r: f"finished: trained all {n} steps (the sweep frees its index)"
                for r, n in done.items()
                if r not in released
            }
            await request_evictions(bus, reasons, requested_by=submitted_by)
            released.update(reasons)
        if halving is None:
            return
        finished = {v.run_id for v, t in zip(views, tasks, strict=True) if t.done()}
        rewards = {v.run_id: v.rewards() for v in views}
        decided = halving.decide(rewards, await active_runs(bus), finished)
        await request_evictions(bus, decided)
        for run_id in decided:
            stops[run_id].set()

    try:
        results = await _watch(
            views, tasks, check, judge, console, live=live, title=title, services=services
        )
    finally:
        forwarder.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(forwarder, *tasks, return_exceptions=True)
    return Driven(views, results, dict(halving.evicted) if halving else {})


async def _watch(  # type: ignore[no-untyped-def]
    views: list[RunView], tasks, check, judge, console: Console, *, live: bool, title: str, services
):
    started = time.monotonic()
    printed = {v.run_id: 0 for v in views}

    def refresh() -> None:
        for v, t in zip(views, tasks, strict=True):
            v.refresh()
            if t.done() and not t.cancelled() and t.exception() is None:
                v.status = t.result().status
            elif t.done():
                v.status = "failed"
            elif v.rows:
                v.status = "training"

    async def loop(update) -> None:  # type: ignore[no-untyped-def]
        while not all(t.done() for t in tasks):
            check()
            refresh()
            update()
            await judge()
            await asyncio.wait(tasks, timeout=0.5)
        refresh()
        update()
        await judge()  # the last runs to finish free their indices too

    if live:

        def table() -> Table:
            return live_table(views, time.monotonic() - started, title, caption=services())

        with Live(table(), console=console, refresh_per_second=4) as screen:
            await loop(lambda: screen.update(table()))
    else:

        def log_lines() -> None:
            for v in views:
                for row in v.rows[printed[v.run_id] :]:
                    console.print(
                        f"{v.run_id} step {int(row['step']) + 1}/{v.max_steps} "
                        f"reward {row['reward_mean']:.3f} lag {row.get('policy_lag', '-')}"
                    )
                printed[v.run_id] = len(v.rows)

        await loop(log_lines)
    return [t.result() for t in tasks]
