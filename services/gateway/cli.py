"""``plexrl gateway``: the HTTP front door (the Tinker API and an OpenAI-compatible API).

Settings come from ``--config FILE`` (TOML), ``PLEXRL_*`` environment variables and flags, in
that order of precedence (see :mod:`services.gateway.settings`). ``SIGTERM`` / ``SIGINT`` stop
it: requests under way finish, then the connection to NATS is drained.

Exit status: 0 after a clean stop, 1 when NATS cannot be reached, 2 for unusable settings
(a model directory without a tokenizer, a port already taken, no tenants file on an address
beyond loopback).
"""

from __future__ import annotations

import argparse
from typing import Any

from services.config import add_common_args, add_settings_flags
from services.gateway.settings import GatewaySettings


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gateway",
        help="serve the Tinker API and an OpenAI-compatible API over HTTP",
        description=(
            "The gateway turns HTTP requests into plexrl events and requests on the bus: the "
            "Tinker API (/api/v1: training clients, sampling clients) and an OpenAI-compatible "
            "API (/v1/models, /v1/completions, /v1/chat/completions) where `model` names a run "
            "(run_x, run_x@<version>) or the base model. It holds no training state."
        ),
    )
    add_common_args(parser)
    add_settings_flags(parser, GatewaySettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.config import SettingsError, nats_url, settings_from_args
    from services.launch import fail, run_service

    try:
        settings = settings_from_args(GatewaySettings, args)
        url = nats_url(args)
    except SettingsError as exc:
        return fail("gateway", exc)
    if not (settings.model / "tokenizer_config.json").is_file():
        return fail(
            "gateway",
            f"{settings.model} holds no tokenizer (no tokenizer_config.json); point --model at "
            f"the model directory the trainer and inference use (`plexrl model tiny DIR` writes "
            "the default one)",
        )
    from services.gateway.app import CannotListen
    from services.gateway.service import KeylessRemote, serve

    return run_service(
        "gateway",
        lambda bus, stop: serve(settings, bus, stop),
        nats_url=url,
        service=settings.service,
        errors={CannotListen: 2, KeylessRemote: 2},
        provision=False,  # the services own the streams; a keyed gateway's account has none
    )
