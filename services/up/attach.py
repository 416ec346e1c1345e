"""``plexrl sweep FILE``: a sweep's orchestrators against a deployment that is already running.

The same expansion (:mod:`services.up.sweep`), driver (:mod:`services.up.drive`) and report
(:mod:`services.up.compare`) as a sweep under ``plexrl up``, without starting NATS, the
registry, the trainer or inference: every run is submitted to the registry found at
``--nats-url``, and runs beyond its ``max_runs`` wait in its queue.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rich.console import Console

from services.bus import Bus
from services.up.compare import report_sweep
from services.up.drive import drive_runs
from services.up.settings import UpSettings
from services.up.sweep import SweepRun


async def run_sweep(
    bus: Bus,
    stop: asyncio.Event,
    settings: UpSettings,
    planned: list[SweepRun],
    output_dir: Path,
    report_dir: Path,
) -> int:
    from services.model.loader import load_tokenizer
    from services.up.app import ensure_tiny_model

    console = Console()
    name = settings.sweep_name
    assert name is not None
    model_dir = (settings.model or ensure_tiny_model(console)).resolve()
    console.print(f"sweep {name}: {len(planned)} runs; output {output_dir}; report {report_dir}")
    driven = await drive_runs(
        bus,
        planned,
        output_dir=output_dir,
        tokenizer=load_tokenizer(model_dir),
        stop=stop,
        console=console,
        live=settings.live and console.is_terminal,
        title=f"plexrl sweep {name}",
        submitted_by="plexrl sweep",
        early_stop=settings.sweep.early_stop if settings.sweep else None,
        release_finished=True,
    )
    for view in driven.views:
        view.refresh()
    report_sweep(planned, driven, name, report_dir, console)
    return driven.exit_code
