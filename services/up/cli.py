"""``plexrl up``: everything on one machine."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from services.config import add_settings_flags
from services.up.settings import UpSettings


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "up",
        help="run everything on this machine: NATS, all services, several demo runs",
        description="Start an embedded NATS server (unless --nats-url or PLEXRL_NATS_URL names "
        "one), the registry, inference and trainer, and one orchestrator per demo run; show live "
        "progress; write a summary, reward plots and metrics.jsonl per run under the output "
        "directory. Settings come from the flags and the --config TOML; PLEXRL_* variables are "
        "passed on to the services.",
    )
    p.add_argument(
        "--config", type=Path, help="TOML with these settings and a [run] table of orch.toml keys"
    )
    p.add_argument(
        "--nats-url",
        default=argparse.SUPPRESS,
        help="use this NATS server instead of an embedded one (env PLEXRL_NATS_URL)",
    )
    add_settings_flags(p, UpSettings, from_env=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.config import (
        ProcessSettings,
        SettingsError,
        flag_values,
        process_settings,
        settings_from_args,
    )
    from services.launch import fail
    from services.up.app import main

    try:
        # Only the flags and the file configure `up`; PLEXRL_* variables are for the services.
        settings = settings_from_args(UpSettings, args, environ={})
        process = process_settings(**flag_values(ProcessSettings, args))
    except SettingsError as exc:
        return fail("up", exc)
    return main(settings, process.nats_url if "nats_url" in process.model_fields_set else None)
