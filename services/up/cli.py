"""``plexrl up``: everything on one machine."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "up",
        help="run everything on this machine: NATS, all services, several demo runs",
        description="Start an embedded NATS server (unless --nats-url names one), the registry, "
        "inference and trainer, and one orchestrator per demo run; show live progress; write a "
        "summary, reward plots and metrics.jsonl per run under the output directory.",
    )
    p.add_argument("--runs", type=int, help="number of demo runs (default 3: reverse, copy, add)")
    p.add_argument("--steps", type=int, help="RL steps per run (default 40)")
    p.add_argument("--max-async-level", type=int, help="steps generation may run ahead (default 1)")
    p.add_argument("--output-dir", type=Path, help="default ./outputs/up-<timestamp>")
    p.add_argument(
        "--model", type=Path, help="model directory (default: the cached warm-started tiny model)"
    )
    p.add_argument(
        "--config", type=Path, help="TOML with these settings and a [run] table of orch.toml keys"
    )
    p.add_argument(
        "--nats-url", help="use this NATS server instead of an embedded one (env PLEXRL_NATS_URL)"
    )
    p.add_argument(
        "--weight-transport",
        choices=["object_store", "filesystem", "ucx", "collective"],
        help="how adapters reach inference (default object_store)",
    )
    p.add_argument(
        "--full-weights",
        action="store_true",
        default=None,
        help="train the model's own weights instead of LoRA (one run; --runs 1)",
    )
    p.add_argument(
        "--no-live", action="store_true", help="print one line per step instead of a live table"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.config import SettingsError, load_settings
    from services.up.app import main
    from services.up.settings import UpSettings

    overrides = {
        "runs": args.runs,
        "steps": args.steps,
        "max_async_level": args.max_async_level,
        "output_dir": args.output_dir,
        "model": args.model,
        "weight_transport": args.weight_transport,
        "full_weights": args.full_weights,
        "live": False if args.no_live else None,
    }
    try:
        # Only the flags and the file configure `up`; PLEXRL_* variables are for the services.
        settings = load_settings(UpSettings, args.config, overrides, environ={})
    except SettingsError as exc:
        print(f"plexrl up: {exc}", file=sys.stderr)
        return 2
    return main(settings, args.nats_url or os.environ.get("PLEXRL_NATS_URL"))
