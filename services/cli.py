"""The ``plexrl`` command line.

Each command lives in a module with ``register(subparsers)``, which adds its parser and sets
``func`` to a callable ``(args) -> int``. Modules import only argparse-level things at import
time; torch and friends are imported inside ``func`` so ``plexrl --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = [
    "services.up.cli",
    "services.registry.cli",
    "services.trainer.cli",
    "services.inference.cli",
    "services.orchestrator.cli",
    "services.gateway.cli",
    "services.registry.client_cli",
    "services.model.cli",
    "services.tenants.cli",
    "services.launch.health",
    "schemas.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plexrl",
        description="Many LoRA RL runs of one model on one shared trainer, over NATS JetStream.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if name == missing or name.startswith(missing + "."):  # not part of this build
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    from services.config import SettingsError
    from services.model.host import tune_allocator

    try:
        tune_allocator()  # before any large tensor exists; see services/model/host.py
    except SettingsError as exc:  # a PLEXRL_* variable every command reads is unusable
        print(f"plexrl: {exc}", file=sys.stderr)
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
