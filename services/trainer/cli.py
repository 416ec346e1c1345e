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
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from services.config import add_common_args


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
    parser.add_argument("--model", type=Path, help="Hugging Face model directory")
    parser.add_argument("--output-dir", type=Path, help="where run directories live (run_*)")
    parser.add_argument("--max-runs", type=int, help="adapter slots, as the registry's pool")
    parser.add_argument(
        "--full-weights",
        action="store_const",
        const=True,
        default=None,
        help="train the model's own parameters instead of LoRA adapters, for one run (needs "
        "--max-runs 1; env PLEXRL_FULL_WEIGHTS)",
    )
    parser.add_argument(
        "--weight-transport",
        choices=["object_store", "filesystem", "ucx", "collective"],
        help="how adapters travel (env PLEXRL_WEIGHT_TRANSPORT, default object_store)",
    )
    parser.add_argument(
        "--ucx-host", help="ucx: the address replicas reach this trainer at (default 127.0.0.1)"
    )
    parser.add_argument("--ucx-port", type=int, help="ucx: listener port (default 0: any free)")
    parser.add_argument("--collective-host", help="collective: rendezvous address")
    parser.add_argument("--collective-port", type=int, help="collective: rendezvous port")
    parser.add_argument(
        "--collective-bucket-bytes", type=int, help="collective: bytes per broadcast"
    )
    parser.add_argument(
        "--micro-batch-tokens", type=int, help="padded tokens per micro-batch (default 8192)"
    )
    parser.add_argument("--max-lora-rank", type=int, help="largest LoRA rank (default 16)")
    parser.add_argument(
        "--target-modules",
        help="comma-separated linear module names that carry adapters (default: every "
        "attention and MLP projection)",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default 0: half the cores)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default float32")
    parser.add_argument(
        "--consumer-name", help="durable consumer name on PLEXRL_ROLLOUTS (default 'trainer')"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.config import SettingsError, load_settings
    from services.config.loader import nats_url
    from services.trainer.settings import TrainerSettings

    overrides = {
        "model": args.model,
        "output_dir": args.output_dir,
        "max_runs": args.max_runs,
        "full_weights": args.full_weights,
        "weight_transport": args.weight_transport,
        "ucx_host": args.ucx_host,
        "ucx_port": args.ucx_port,
        "collective_host": args.collective_host,
        "collective_port": args.collective_port,
        "collective_bucket_bytes": args.collective_bucket_bytes,
        "micro_batch_tokens": args.micro_batch_tokens,
        "max_lora_rank": args.max_lora_rank,
        "target_modules": args.target_modules,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "consumer_name": args.consumer_name,
    }
    try:
        settings = load_settings(TrainerSettings, args.config, overrides)
    except SettingsError as exc:
        print(f"plexrl trainer: {exc}", file=sys.stderr)
        return 2
    from services.weights.transport import unavailable_reason

    reason = unavailable_reason(settings.weight_transport)
    if reason is not None:
        print(f"plexrl trainer: {reason}", file=sys.stderr)
        return 2
    if not (settings.model / "config.json").is_file():
        print(
            f"plexrl trainer: {settings.model} is not a Hugging Face model directory (no "
            f"config.json); write the default tiny model with `plexrl model tiny {settings.model}`"
            " or point --model at a downloaded one",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return _main(settings, nats_url(args))


def _main(settings: Any, url: str) -> int:
    import torch

    from services.bus import BusUnavailable, setup_tracing
    from services.bus.tracing import shutdown_tracing
    from services.trainer.distributed import close_ranks, init_ranks
    from services.weights.errors import TransportUnavailable

    if settings.device == "cuda" and not torch.cuda.is_available():
        print("plexrl trainer: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    torch.set_num_threads(settings.num_threads)
    setup_tracing(settings.service)
    from services.telemetry.metrics import setup_metrics

    setup_metrics(settings.service)
    ranks = init_ranks(settings.device)
    try:
        asyncio.run(_serve(settings, url, ranks))
    except BusUnavailable as exc:
        print(f"plexrl trainer: {exc}", file=sys.stderr)
        return 1
    except TransportUnavailable as exc:
        print(f"plexrl trainer: {exc}", file=sys.stderr)
        return 2
    finally:
        shutdown_tracing()
        close_ranks(ranks)
    return 0


async def _serve(settings: Any, url: str, ranks: Any) -> None:
    from services.bus import stop_on_signals
    from services.trainer.service import serve

    await serve(settings, url, stop_on_signals(), ranks)
