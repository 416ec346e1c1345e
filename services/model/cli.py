"""``plexrl model``: write and inspect the models the services share.

``plexrl model tiny DIR [--seed N] [--no-pretrain] [--pretrain-steps N]`` writes the default tiny
Llama with its character tokenizer into DIR (Hugging Face format), then warm-starts it with a
short deterministic pre-training on demonstrations of the built-in tasks, most of them slipped (see
``services.model.pretrain``) unless ``--no-pretrain`` is given. It prints one line saying what it
wrote and, after pre-training, one line with the sampled reward per task; progress goes to
stderr. Imports of torch and transformers happen inside the command so ``plexrl --help`` stays
instant.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "model",
        help="write the default tiny model",
        description="Models shared by the trainer and inference services.",
    )
    model_sub = parser.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    tiny = model_sub.add_parser(
        "tiny",
        help="write the default tiny Llama with a character tokenizer",
        description=(
            "Write the default tiny Llama (Hugging Face format, character-level tokenizer) into "
            "DIR and pre-train it for about a minute on demonstrations of the built-in "
            "tasks (reverse, copy, upper, rotate, add), most of them showing a plausible mistake, so that RL "
            "starts from a model that knows the right answer but prefers a wrong one. The same "
            "seed always gives bit-identical weights; nothing is downloaded."
        ),
    )
    tiny.add_argument("dir", type=Path, metavar="DIR", help="directory to write the model into")
    tiny.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the initialisation and pre-training (default 0)",
    )
    tiny.add_argument(
        "--no-pretrain",
        dest="pretrain",
        action="store_false",
        help="write the randomly initialised model only",
    )
    tiny.add_argument(
        "--pretrain-steps",
        type=_positive_int,
        default=None,
        metavar="N",
        help="pre-training steps (default: the tuned default of services.model.pretrain)",
    )
    tiny.set_defaults(func=run_tiny)
    parser.set_defaults(func=lambda args: _print_help(parser))


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run_tiny(args: argparse.Namespace) -> int:
    import sys

    from services.model.pretrain import PRETRAIN_FILE
    from services.model.tiny import build_tiny

    summary = build_tiny(args.dir, seed=args.seed)
    # A pretrain.json left by an earlier build would mark these fresh weights as pre-trained.
    (summary.path / PRETRAIN_FILE).unlink(missing_ok=True)
    print(
        f"wrote tiny Llama to {summary.path}: {summary.num_parameters:,} parameters, "
        f"vocab {summary.vocab_size}, seed {args.seed}",
        flush=True,
    )
    if not args.pretrain:
        return 0
    from services.model.pretrain import DEFAULT_STEPS, pretrain

    report = pretrain(
        summary.path,
        steps=args.pretrain_steps or DEFAULT_STEPS,
        seed=args.seed,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    rewards = ", ".join(f"{name} {reward:.2f}" for name, reward in report.rewards.items())
    print(
        f"pre-trained for {report.steps} steps in {report.seconds:.0f}s: "
        f"final loss {report.final_loss:.3f}, sampled reward {rewards}"
    )
    return 0
