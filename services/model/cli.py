"""``plexrl model``: write and inspect the models the services share.

``plexrl model tiny DIR [--seed N]`` writes the default tiny Llama with its character tokenizer
into DIR (Hugging Face format) and prints one line saying what it wrote. Imports of torch and
transformers happen inside the command so ``plexrl --help`` stays instant.
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
            "DIR. The same seed always gives bit-identical weights; nothing is downloaded."
        ),
    )
    tiny.add_argument("dir", type=Path, metavar="DIR", help="directory to write the model into")
    tiny.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    tiny.set_defaults(func=run_tiny)
    parser.set_defaults(func=lambda args: _print_help(parser))


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def run_tiny(args: argparse.Namespace) -> int:
    from services.model.tiny import build_tiny

    summary = build_tiny(args.dir, seed=args.seed)
    print(
        f"wrote tiny Llama to {summary.path}: {summary.num_parameters:,} parameters, "
        f"vocab {summary.vocab_size}, seed {args.seed}"
    )
    return 0
