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
import sys
from pathlib import Path
from typing import Any

from services.config import add_common_args, add_settings_flags
from services.orchestrator.settings import OrchestratorSettings

COMMAND = "orchestrator"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        COMMAND,
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
        dest="run_config",
        type=Path,
        metavar="ORCH.toml",
        help="the run's config (default: OUTPUT_DIR/RUN_ID/control/orch.toml, where the registry "
        "keeps it)",
    )
    add_common_args(parser, config=False)
    add_settings_flags(parser, OrchestratorSettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from schemas.config import ConfigError, load_orch_config
    from schemas.run_id import InvalidRunId, validate_run_id
    from services.config import SettingsError, nats_url, settings_from_args
    from services.launch import fail, run_service

    try:
        run_id = validate_run_id(args.run_id)
        settings = settings_from_args(OrchestratorSettings, args)
        url = nats_url(args)
        config = load_orch_config(
            args.run_config or settings.output_dir / run_id / "control" / "orch.toml"
        )
    except (InvalidRunId, ConfigError, SettingsError) as exc:
        return fail(COMMAND, exc)
    if settings.model is None:
        return fail(
            COMMAND,
            "say which tokenizer encodes the prompts: --model DIR (or PLEXRL_MODEL), the model "
            "inference serves; `plexrl model tiny DIR` writes the default tiny model",
        )
    from services.envs import EnvLoadError
    from services.model.loader import ModelDirectoryError, load_tokenizer
    from services.orchestrator.run_loop import RunOrchestrator

    try:
        tokenizer = load_tokenizer(settings.model)
    except (ModelDirectoryError, OSError) as exc:
        return fail(COMMAND, f"cannot load the tokenizer from {settings.model}: {exc}")

    async def serve(bus: Any, stop: asyncio.Event) -> int:
        orchestrator = RunOrchestrator(
            bus,
            run_id,
            config,
            output_dir=settings.output_dir,
            tokenizer=tokenizer,
            request_timeout=settings.request_timeout,
            progress_every_s=settings.progress_every_s,
            wait_for_training=settings.wait_for_training,
            max_concurrent_requests=settings.max_concurrent_requests,
            submitted_by=f"plexrl {COMMAND} ({_who()})",
            registry_service=settings.registry_service,
        )
        result = await orchestrator.run(stop)
        _report(run_id, config.max_steps, result)
        return int(result.exit_code)

    return run_service(COMMAND, serve, nats_url=url, service=COMMAND, errors={EnvLoadError: 2})


def _who() -> str:
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _report(run_id: str, max_steps: int, result: Any) -> None:
    match result.status:
        case "done":
            print(
                f"{run_id}: done: {max_steps} steps ({result.steps_published} published "
                f"by this process), policy version {result.policy_version}"
            )
        case "stopped":
            print(f"{run_id}: stopped; it resumes at step {result.next_step}")
        case "evicted":
            print(f"{run_id} evicted: {result.reason}", file=sys.stderr)
        case "rejected":
            print(f"plexrl {COMMAND}: {result.reason}", file=sys.stderr)
        case "failed":
            print(
                f"plexrl {COMMAND}: {run_id} failed at step {result.next_step}: {result.reason}",
                file=sys.stderr,
            )
