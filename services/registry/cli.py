"""``plexrl registry``: run the registry service.

Settings come from ``--config FILE`` (TOML), ``PLEXRL_*`` environment variables and flags, in
that order of precedence (see :mod:`services.registry.settings`). ``SIGHUP`` asks for an
immediate scan of ``output_dir``; ``SIGTERM`` / ``SIGINT`` stop the service cleanly.

Exit status: 0 after a clean stop, 1 when NATS cannot be reached, 2 for unusable settings (a
validation hook that does not load, a tenants file that does not parse, a ``--model`` whose LoRA
targets the trainer cannot wrap).
"""

from __future__ import annotations

import argparse
from typing import Any

from services.config import add_common_args, add_settings_flags
from services.registry.settings import RegistrySettings


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "registry",
        help="run the registry: discovers, validates and indexes runs",
        description=(
            "The registry owns run identity: it discovers runs in OUTPUT_DIR/run_*/control/"
            "orch.toml and from RunSubmitted events, validates their config, gives each an "
            "index from a pool of --max-runs (fair share across tenants, quotas from "
            "--tenants-file), evicts and forgets runs, keeps its table in KV plexrl-registry, "
            "publishes lifecycle events on PLEXRL_RUNS and answers plexrl.registry.list."
        ),
    )
    add_common_args(parser)
    add_settings_flags(
        parser, RegistrySettings, aliases={"validation_hooks": ["--validation-hook"]}
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from services.config import SettingsError, nats_url, settings_from_args
    from services.config.tenants import TenantsFileError, load_tenants
    from services.launch import fail, run_service
    from services.registry.service import Registry, RegistryError
    from services.registry.validation import DeploymentError, HookLoadError, make_validator

    try:
        settings = settings_from_args(RegistrySettings, args)
        url = nats_url(args)
        # Load the hooks and the tenants file and check the model's LoRA targets before
        # connecting: a mistake in any of them is a usage error.
        validator = make_validator(
            settings.max_lora_rank,
            settings.max_async_level,
            settings.validation_hooks,
            model=settings.model,
            target_modules=settings.target_modules,
        )
        tenants = load_tenants(settings.tenants_file)
    except (SettingsError, HookLoadError, DeploymentError, TenantsFileError) as exc:
        return fail("registry", exc)

    async def serve(bus: Any, stop: asyncio.Event) -> None:
        registry = Registry(bus, settings, validator=validator, tenants=tenants)
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, registry.request_scan)
        except (NotImplementedError, RuntimeError):  # no SIGHUP on this platform
            pass
        await registry.run(stop)

    return run_service(
        "registry", serve, nats_url=url, service=settings.service, errors={RegistryError: 2}
    )
