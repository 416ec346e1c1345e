"""``plexrl up``: everything on one machine; ``plexrl sweep``: a sweep on a running deployment."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from services.config import add_settings_flags
from services.up.settings import UpSettings


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "up",
        help="run everything on this machine: NATS, all services, several demo runs or a sweep",
        description="Start an embedded NATS server (unless --nats-url or PLEXRL_NATS_URL names "
        "one), the registry, inference and trainer, and one orchestrator per demo run (or per "
        "run of the config's [sweep] table); show live progress; write a summary, reward plots "
        "and metrics.jsonl per run under the output directory. Settings come from the flags and "
        "the --config TOML; PLEXRL_* variables are passed on to the services.",
    )
    p.add_argument(
        "--config",
        type=Path,
        help="TOML with these settings, a [run] table of orch.toml keys and an optional [sweep]",
    )
    p.add_argument(
        "--nats-url",
        default=argparse.SUPPRESS,
        help="use this NATS server instead of an embedded one (env PLEXRL_NATS_URL)",
    )
    add_settings_flags(p, UpSettings, from_env=False)
    p.set_defaults(func=run)

    s = subparsers.add_parser(
        "sweep",
        help="train a sweep's runs on a running deployment and compare them",
        description="Expand FILE's [sweep] table (the `plexrl up` config format) into runs, drive "
        "one orchestrator per run against the services at --nats-url (runs beyond the "
        "registry's max_runs wait for an index), then print the comparison and write sweep.json, "
        "sweep.csv and sweep.png.",
    )
    s.add_argument("config", type=Path, metavar="FILE", help="TOML with a [sweep] table")
    s.add_argument(
        "--report-dir",
        type=Path,
        help="where sweep.json/csv/png go (default: <output-dir>/sweep-<name>)",
    )
    s.add_argument(
        "--nats-url",
        default=argparse.SUPPRESS,
        help="the deployment's NATS server (env PLEXRL_NATS_URL; default nats://127.0.0.1:4222)",
    )
    s.add_argument(
        "--output-dir",
        dest="output_dir",
        type=Path,
        default=argparse.SUPPRESS,
        help="where the runs' metrics go: the deployment's output directory, to keep each run's "
        "files in one place (default: ./outputs/sweep-<name>)",
    )
    add_settings_flags(s, UpSettings, only=("model", "steps", "live"), from_env=False)
    s.set_defaults(func=run_sweep)


def _settings(args: argparse.Namespace) -> tuple[UpSettings, Any, Any]:
    from services.config import ProcessSettings, flag_values, process_settings, settings_from_args

    # Only the flags and the file configure `up`; PLEXRL_* variables are for the services.
    settings = settings_from_args(UpSettings, args, environ={})
    return settings, settings.planned_runs(), process_settings(**flag_values(ProcessSettings, args))


def run(args: argparse.Namespace) -> int:
    from schemas.config import ConfigError
    from services.config import SettingsError
    from services.launch import fail
    from services.up.app import main

    try:
        settings, planned, process = _settings(args)
    except (SettingsError, ConfigError) as exc:
        return fail("up", exc)
    return main(
        settings, planned, process.nats_url if "nats_url" in process.model_fields_set else None
    )


def run_sweep(args: argparse.Namespace) -> int:
    from schemas.config import ConfigError
    from services.config import SettingsError
    from services.launch import fail, run_service
    from services.up.attach import run_sweep as body

    try:
        settings, planned, process = _settings(args)
    except (SettingsError, ConfigError) as exc:
        return fail("sweep", exc)
    if settings.sweep_name is None:
        return fail("sweep", f"{args.config} has no [sweep] table; see docs/runs.md, Sweeps")
    output_dir = (settings.output_dir or Path("outputs") / f"sweep-{settings.sweep_name}").resolve()
    report_dir = (args.report_dir or output_dir / f"sweep-{settings.sweep_name}").resolve()
    return run_service(
        "sweep",
        lambda bus, stop: body(bus, stop, settings, planned, output_dir, report_dir),
        nats_url=process.nats_url,
        service="orchestrator",
        bus_name="sweep",
    )
