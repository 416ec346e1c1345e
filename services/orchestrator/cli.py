"""``plexrl orchestrator RUN_ID [--config orch.toml]``: drive one run.

The run's config is ``--config``, or else the ``control/orch.toml`` the registry keeps in the
run's directory. The run is submitted to the registry unless the registry already holds it,
then driven until ``max_steps`` steps are published and (unless ``--no-wait-for-training``)
trained on. Settings other than the run's own config come from ``PLEXRL_*`` environment
variables and flags (see :mod:`services.orchestrator.settings`).

Exit status: 0 done (or stopped by SIGTERM / SIGINT after a clean checkpoint), 1 an error
(NATS unreachable, inference refusing requests), 2 a bad config, run id or model directory, or
a run the registry rejected, 3 the run was evicted ("run_x evicted: <reason>" on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import socket
import sys
from pathlib import Path
from typing import Any

from services.config.loader import DEFAULT_NATS_URL

PROG = "plexrl orchestrator"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "orchestrator",
        help="drive one run: generate, score and publish its rollouts",
        description=(
            "Submit RUN_ID to the registry (unless it already holds it), then, step by step, ask "
            "inference for completions, score them with the run's environment, compute "
            "group-relative advantages and publish RolloutBatch events, staying at most "
            "max_async_level steps ahead of the trainer. Resumes where a previous orchestrator "
            "of the run stopped."
        ),
    )
    parser.add_argument("run_id", metavar="RUN_ID", help="'run_' + 1-64 letters, digits, _ or -")
    parser.add_argument(
        "--config",
        type=Path,
        metavar="ORCH.toml",
        help="the run's config (default: OUTPUT_DIR/RUN_ID/control/orch.toml, where the registry "
        "keeps it)",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        help="where run directories live (env PLEXRL_OUTPUT_DIR, default outputs)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        metavar="DIR",
        help="model directory to take the tokenizer from: the model inference serves "
        "(env PLEXRL_MODEL)",
    )
    parser.add_argument(
        "--nats-url",
        default=None,
        help=f"NATS server (env PLEXRL_NATS_URL, default {DEFAULT_NATS_URL})",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        metavar="S",
        help="seconds a generate request may take before it is retried (default 120)",
    )
    parser.add_argument(
        "--wait-for-training",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after the last step, wait until the trainer has trained on it (default: wait)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from schemas.config import ConfigError, load_orch_config
    from schemas.run_id import InvalidRunId, validate_run_id
    from services.config import SettingsError, load_settings
    from services.orchestrator.settings import OrchestratorSettings

    overrides = {
        "output_dir": args.output_dir,
        "model": args.model,
        "request_timeout": args.request_timeout,
        "wait_for_training": args.wait_for_training,
    }
    try:
        run_id = validate_run_id(args.run_id)
        settings = load_settings(OrchestratorSettings, None, overrides)
        config = load_orch_config(
            args.config or settings.output_dir / run_id / "control" / "orch.toml"
        )
    except (InvalidRunId, ConfigError, SettingsError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if settings.model is None:
        print(
            f"{PROG}: say which tokenizer encodes the prompts: --model DIR (or PLEXRL_MODEL), "
            "the model inference serves; `plexrl model tiny DIR` writes the default tiny model",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from services.model.loader import ModelDirectoryError, load_tokenizer
    from services.orchestrator.envs import EnvLoadError

    try:
        tokenizer = load_tokenizer(settings.model)
    except (ModelDirectoryError, OSError) as exc:
        print(f"{PROG}: cannot load the tokenizer from {settings.model}: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(run_id, config, settings, tokenizer, args))
    except EnvLoadError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


async def _serve(
    run_id: str, config: Any, settings: Any, tokenizer: Any, args: argparse.Namespace
) -> int:
    from services.bus import Bus, BusUnavailable, setup_tracing, stop_on_signals
    from services.bus.tracing import shutdown_tracing
    from services.config.loader import nats_url
    from services.orchestrator.run_loop import RunOrchestrator
    from services.telemetry.metrics import setup_metrics

    setup_tracing("orchestrator")
    setup_metrics("orchestrator")
    stop = stop_on_signals()
    try:
        bus = await Bus.connect(nats_url(args), "orchestrator")
    except BusUnavailable as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    try:
        orchestrator = RunOrchestrator(
            bus,
            run_id,
            config,
            output_dir=settings.output_dir,
            tokenizer=tokenizer,
            request_timeout=settings.request_timeout,
            wait_for_training=settings.wait_for_training,
            max_concurrent_requests=settings.max_concurrent_requests,
            submitted_by=f"{PROG} ({_who()})",
            registry_service=settings.registry_service,
        )
        result = await orchestrator.run(stop)
    finally:
        await bus.close()
        shutdown_tracing()
    match result.status:
        case "done":
            print(
                f"{run_id}: done: {config.max_steps} steps ({result.steps_published} published "
                f"by this process), policy version {result.policy_version}"
            )
        case "stopped":
            print(f"{run_id}: stopped; it resumes at step {result.next_step}")
        case "evicted":
            print(f"{run_id} evicted: {result.reason}", file=sys.stderr)
        case "rejected":
            print(f"{PROG}: {result.reason}", file=sys.stderr)
        case "failed":
            print(
                f"{PROG}: {run_id} failed at step {result.next_step}: {result.reason}",
                file=sys.stderr,
            )
    return result.exit_code
