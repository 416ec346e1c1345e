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
from typing import Any

from services.config import add_common_args, add_settings_flags
from services.inference.settings import InferenceSettings


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
    add_settings_flags(parser, InferenceSettings)
    parser.set_defaults(func=run)


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot run on this machine (no vllm, no GPU)."""


def run(args: argparse.Namespace) -> int:
    import asyncio

    from services.config import SettingsError, nats_url, settings_from_args
    from services.inference.admission import HttpBound
    from services.inference.service import InferenceService
    from services.launch import fail, run_service
    from services.model.loader import ModelDirectoryError, check_model_dir

    try:
        settings = settings_from_args(InferenceSettings, args)
        url = nats_url(args)
        check_model_dir(settings.model)
    except (SettingsError, ModelDirectoryError) as exc:
        return fail("inference", exc)
    try:
        engine = build_engine(settings)  # before connecting: a missing engine is a usage error
    except EngineUnavailable as exc:
        return fail("inference", exc, 3)

    async def serve(bus: Any, stop: asyncio.Event) -> None:
        service = InferenceService(
            bus,
            engine,
            max_runs=settings.max_runs,
            replica_name=settings.replica_name,
            output_dir=settings.output_dir,
            weight_load_attempts=settings.weight_load_attempts,
            weight_transport=settings.weight_transport,
            max_request_tokens=settings.max_request_tokens,
            http_bound=HttpBound(
                settings.max_http_requests,
                settings.max_http_tokens,
                settings.overload_retry_after_s,
            ),
        )
        await service.run(stop)

    return run_service("inference", serve, nats_url=url, service=settings.service)


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
            max_snapshots=settings.max_snapshots,
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
        max_snapshots=settings.max_snapshots,
        max_lora_rank=settings.max_lora_rank,
        target_modules=settings.target_modules,
        device=settings.torch_device(),
        dtype=settings.torch_dtype(),
        batch_window_ms=settings.batch_window_ms,
        max_batch_tokens=settings.max_batch_tokens,
        max_num_seqs=settings.max_num_seqs,
        paged=settings.paged,
        cuda_graphs=settings.cuda_graphs,
        http_share=settings.http_share,
    )
