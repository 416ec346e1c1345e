"""``plexrl registry``: run the registry service.

Settings come from ``--config FILE`` (TOML), ``PLEXRL_*`` environment variables and flags, in
that order of precedence (see :mod:`services.registry.settings`). ``SIGHUP`` asks for an
immediate scan of ``output_dir``; ``SIGTERM`` / ``SIGINT`` stop the service cleanly.

Exit status: 0 after a clean stop, 1 when NATS cannot be reached, 2 for unusable settings.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from services.config import add_common_args


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "registry",
        help="run the registry: discovers, validates and indexes runs",
        description=(
            "The registry owns run identity: it discovers runs in OUTPUT_DIR/run_*/control/"
            "orch.toml and from RunSubmitted events, validates their config, gives each an "
            "index from a pool of --max-runs, evicts and forgets runs, keeps its table in KV "
            "plexrl-registry and publishes lifecycle events on PLEXRL_RUNS."
        ),
    )
    add_common_args(parser)
    parser.add_argument("--output-dir", type=Path, help="where run directories live (run_*)")
    parser.add_argument("--max-runs", type=int, help="size of the index pool (default 4)")
    parser.add_argument(
        "--scan-interval", type=float, help="seconds between scans of OUTPUT_DIR (default 5)"
    )
    parser.add_argument(
        "--validation-hook",
        dest="validation_hooks",
        action="extend",
        nargs="+",
        metavar="MODULE:FUNCTION",
        help="extra config checks, each called with the OrchConfig and returning (ok, message)",
    )
    parser.add_argument(
        "--max-lora-rank", type=int, help="largest LoRA rank a run may ask for (default 16)"
    )
    parser.add_argument(
        "--max-async-level", type=int, help="largest max_async_level a run may ask for"
    )
    parser.add_argument(
        "--consumer-name",
        help="prefix of this registry's durable consumers (default 'registry')",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.bus import BusUnavailable
    from services.config import SettingsError, load_settings
    from services.config.loader import nats_url
    from services.registry.service import RegistryError
    from services.registry.settings import RegistrySettings
    from services.registry.validation import HookLoadError, make_validator

    overrides = {
        "output_dir": args.output_dir,
        "max_runs": args.max_runs,
        "scan_interval": args.scan_interval,
        "validation_hooks": args.validation_hooks,
        "max_lora_rank": args.max_lora_rank,
        "max_async_level": args.max_async_level,
        "consumer_name": args.consumer_name,
    }
    try:
        settings = load_settings(RegistrySettings, args.config, overrides)
        # Load the hooks before connecting: a typo in a hook name is a usage error.
        make_validator(settings.max_lora_rank, settings.max_async_level, settings.validation_hooks)
    except (SettingsError, HookLoadError) as exc:
        print(f"plexrl registry: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(_serve(settings, nats_url(args)))
    except BusUnavailable as exc:
        print(f"plexrl registry: {exc}", file=sys.stderr)
        return 1
    except RegistryError as exc:
        print(f"plexrl registry: {exc}", file=sys.stderr)
        return 2
    return 0


async def _serve(settings: Any, url: str) -> None:
    from services.bus import Bus, setup_tracing, stop_on_signals
    from services.bus.tracing import shutdown_tracing
    from services.registry.service import Registry
    from services.telemetry.metrics import setup_metrics

    setup_tracing(settings.service)
    setup_metrics(settings.service)
    bus = await Bus.connect(url, settings.service)
    try:
        registry = Registry(bus, settings)
        stop = stop_on_signals()
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, registry.request_scan)
        except (NotImplementedError, RuntimeError):  # no SIGHUP on this platform
            pass
        await registry.run(stop)
    finally:
        await bus.close()
        shutdown_tracing()
