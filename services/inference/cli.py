"""``plexrl inference``: run one inference replica.

Settings come from ``--config FILE`` (TOML), ``PLEXRL_*`` environment variables and flags, in
that order of precedence (see :mod:`services.inference.settings`). Start as many replicas as you
like against one NATS server: they share requests through the queue group ``inference`` and each
loads every adapter. ``SIGTERM`` / ``SIGINT`` stop taking requests, let those in flight finish
and exit.

Exit status: 0 after a clean stop, 1 when NATS cannot be reached, 2 for unusable settings or
model directory, 3 when the vllm engine is asked for but cannot run here.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from services.config import add_common_args


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inference",
        help="run an inference replica: completions with logprobs under each run's adapter",
        description=(
            "Serve GenerateRequests on plexrl.inference.generate (queue group 'inference') with "
            "one LoRA adapter per run, kept in step with the registry and loaded from every "
            "WeightsReady on PLEXRL_WEIGHTS."
        ),
    )
    add_common_args(parser)
    parser.add_argument("--engine", choices=["torch", "vllm"], help="generation engine")
    parser.add_argument("--model", type=Path, metavar="DIR", help="Hugging Face model directory")
    parser.add_argument("--max-runs", type=int, help="adapter slots, as the registry's (4)")
    parser.add_argument("--max-lora-rank", type=int, help="largest adapter rank served (16)")
    parser.add_argument(
        "--target-modules", help="comma-separated LoRA target modules, as the trainer's"
    )
    parser.add_argument(
        "--output-dir", type=Path, help="run directories (filesystem-transport weights)"
    )
    parser.add_argument(
        "--batch-window-ms", type=float, help="how long a batch waits for more requests (5)"
    )
    parser.add_argument(
        "--max-batch-tokens", type=int, help="prompt + completion tokens per batch (16384)"
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N (auto)")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model dtype (auto: float32 on CPU, bfloat16 on GPU)",
    )
    parser.add_argument("--replica-name", help="name sent in the Plexrl-Replica reply header")
    parser.add_argument(
        "--weight-load-attempts", type=int, help="tries per adapter before giving it up (2)"
    )
    parser.add_argument(
        "--weight-transport",
        choices=["object_store", "filesystem", "ucx", "collective"],
        help="the trainer's weight transport; 'collective' joins its broadcast group at start-up "
        "(env PLEXRL_WEIGHT_TRANSPORT, default object_store)",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, help="vllm: GPU memory fraction (0.85)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.bus import BusUnavailable
    from services.config import SettingsError, load_settings
    from services.config.loader import nats_url
    from services.inference.settings import InferenceSettings
    from services.model.loader import ModelDirectoryError, check_model_dir

    names = (
        "engine",
        "model",
        "max_runs",
        "max_lora_rank",
        "target_modules",
        "output_dir",
        "batch_window_ms",
        "max_batch_tokens",
        "threads",
        "device",
        "dtype",
        "replica_name",
        "weight_load_attempts",
        "weight_transport",
        "gpu_memory_utilization",
    )
    try:
        settings = load_settings(
            InferenceSettings, args.config, {name: getattr(args, name) for name in names}
        )
        check_model_dir(settings.model)
    except (SettingsError, ModelDirectoryError) as exc:
        print(f"plexrl inference: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(_serve(settings, nats_url(args)))
    except BusUnavailable as exc:
        print(f"plexrl inference: {exc}", file=sys.stderr)
        return 1
    except EngineUnavailable as exc:
        print(f"plexrl inference: {exc}", file=sys.stderr)
        return 3
    return 0


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot run on this machine (no vllm, no GPU)."""


def build_engine(settings: Any) -> Any:
    """The engine ``settings.engine`` names, configured from the settings."""
    if settings.engine == "vllm":
        from services.inference.vllm_engine import VllmEngine, vllm_unavailable_reason

        reason = vllm_unavailable_reason()
        if reason:
            raise EngineUnavailable(f"--engine vllm: {reason}; use --engine torch")
        return VllmEngine(
            settings.model,
            max_runs=settings.max_runs,
            max_lora_rank=settings.max_lora_rank,
            output_dir=settings.output_dir,
            replica_name=settings.replica_name,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            dtype=settings.dtype,
        )
    import torch

    from services.inference.torch_engine import TorchEngine

    if settings.threads:
        torch.set_num_threads(settings.threads)
    return TorchEngine(
        settings.model,
        max_runs=settings.max_runs,
        max_lora_rank=settings.max_lora_rank,
        target_modules=settings.target_modules,
        device=settings.torch_device(),
        dtype=settings.torch_dtype(),
        batch_window_ms=settings.batch_window_ms,
        max_batch_tokens=settings.max_batch_tokens,
    )


async def _serve(settings: Any, url: str) -> None:
    from services.bus import Bus, setup_tracing, stop_on_signals
    from services.bus.tracing import shutdown_tracing
    from services.inference.service import InferenceService
    from services.telemetry.metrics import setup_metrics

    setup_tracing(settings.service)
    setup_metrics(settings.service)
    engine = build_engine(settings)
    bus = await Bus.connect(url, settings.service)
    try:
        service = InferenceService(
            bus,
            engine,
            max_runs=settings.max_runs,
            replica_name=settings.replica_name,
            output_dir=settings.output_dir,
            weight_load_attempts=settings.weight_load_attempts,
            weight_transport=settings.weight_transport,
        )
        await service.run(stop_on_signals())
    finally:
        await bus.close()
        shutdown_tracing()
