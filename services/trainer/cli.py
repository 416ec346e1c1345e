"""``plexrl trainer``: run the multi-run LoRA trainer service.

Settings come from ``--config FILE`` (TOML), ``PLEXRL_*`` environment variables and flags, in
that order of precedence (see :mod:`services.trainer.settings`). ``SIGTERM`` / ``SIGINT`` stop
it cleanly: the step under way finishes and is committed, held batches go back to the server.
Under ``torchrun`` every rank runs this same command (gloo on CPU, NCCL with ``--device cuda``).

Exit status: 0 after a clean stop, 1 when NATS cannot be reached, 2 for unusable settings
(a weight transport this machine cannot run, for one: ``ucx`` without ucxx, ``collective``
without torch.distributed, a UCX port already taken).
"""

from __future__ import annotations

import argparse
from typing import Any

from services.config import add_common_args, add_settings_flags
from services.trainer.settings import TrainerSettings


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "trainer",
        help="run the trainer: many runs' LoRA adapters on one shared model",
        description=(
            "The trainer holds one base model whose linear layers carry --max-runs LoRA adapter "
            "slots. It follows the registry's run events, consumes RolloutBatch events from "
            "PLEXRL_ROLLOUTS, trains every run whose next batch is there in shared micro-batches, "
            "checkpoints each run under OUTPUT_DIR/<run_id>/checkpoints/, announces each new "
            "adapter with WeightsReady and writes progress to KV plexrl-progress."
        ),
    )
    add_common_args(parser)
    add_settings_flags(parser, TrainerSettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.config import SettingsError, nats_url, settings_from_args
    from services.launch import fail, run_service
    from services.weights.transport import unavailable_reason

    try:
        settings = settings_from_args(TrainerSettings, args)
        url = nats_url(args)
    except SettingsError as exc:
        return fail("trainer", exc)
    reason = unavailable_reason(settings.weight_transport)
    if reason is not None:
        return fail("trainer", reason)
    if not (settings.model / "config.json").is_file():
        return fail(
            "trainer",
            f"{settings.model} is not a Hugging Face model directory (no config.json); write the "
            f"default tiny model with `plexrl model tiny {settings.model}` or point --model at a "
            "downloaded one",
        )
    import torch

    from services.trainer.distributed import close_ranks, init_ranks
    from services.trainer.service import serve
    from services.weights.errors import TransportUnavailable

    if settings.device == "cuda" and not torch.cuda.is_available():
        return fail("trainer", "--device cuda, but torch sees no CUDA device")
    torch.set_num_threads(settings.num_threads)
    ranks = init_ranks(settings.device, settings.sharding)
    try:
        return run_service(
            "trainer",
            lambda bus, stop: serve(settings, bus, stop, ranks),
            nats_url=url,
            service=settings.service,
            bus_name=settings.service if ranks.is_main else f"{settings.service}-{ranks.rank}",
            errors={TransportUnavailable: 2},
        )
    finally:
        close_ranks(ranks)
