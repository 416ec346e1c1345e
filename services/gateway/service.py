"""``plexrl gateway`` as a service: the tokenizer, who it acts for, the HTTP server.

The gateway holds no training state: stop it, start it again, and clients carry on after
retrying (runs, adapters and checkpoints live in the registry and the trainer; pending futures
of a stopped gateway are gone, and the SDKs resend what they had not got an answer for).

With a tenants file the gateway's own connection (its credentials, ``PLEXRL_NATS_CREDS``) only
answers health checks: each tenant's requests go over a connection of that tenant's own
(:mod:`services.gateway.tenancy`), so the gateway never needs the services' key.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from pathlib import Path

from services.bus import Bus, BusUnavailable
from services.config import process_settings
from services.gateway.admission import Admission
from services.gateway.app import Gateway, build_app, serve_http
from services.gateway.backend import Backend, GatewayError
from services.gateway.settings import GatewaySettings
from services.gateway.tenancy import Tenancy, is_loopback
from services.gateway.text import TextCodec

log = logging.getLogger(__name__)


class KeylessRemote(RuntimeError):
    """A gateway without API keys asked to listen beyond loopback."""


def base_run_id_of(tenant: str, seed: Path) -> str:
    """The base-model run of a tenant's gateway backend: derived from the tenant's secret seed,
    so it is the same after a restart and no other tenant can guess (and take) it."""
    secret = seed.read_bytes().strip()
    digest = hmac.new(secret, f"plexrl-gateway-base/{tenant}".encode(), hashlib.sha256)
    return f"run_gwbase_{digest.hexdigest()[:24]}"


def tenancy_for(settings: GatewaySettings, bus: Bus) -> Tenancy:
    """Keyless for the gateway's own tenant without a tenants file; keyed with one. Every
    tenant's backend counts against one bound on generation under way."""
    admission = Admission(
        settings.max_inflight_requests, settings.max_inflight_tokens, settings.retry_after_s
    )
    if settings.tenants_file is None:
        tenant = process_settings().tenant
        if not is_loopback(settings.host) and not settings.allow_no_keys:
            raise KeylessRemote(
                f"no tenants file: the gateway would serve tenant {tenant} to anyone who reaches "
                f"{settings.host}:{settings.port} without an API key; give it the tenants file "
                "(--tenants-file, PLEXRL_TENANTS_FILE), listen on 127.0.0.1, or set "
                "--allow-no-keys"
            )
        message = (
            f"gateway: no tenants file: serving tenant {tenant} without API keys on "
            f"{settings.host} (anyone who reaches the port acts as that tenant)"
        )
        log.warning(message)
        print(f"plexrl {message}", flush=True)
        return Tenancy(settings, default=Backend(bus, settings, tenant, admission=admission))
    directory = settings.tenants_file.parent
    url = ",".join(bus.servers)

    async def connect(tenant: str) -> Backend:
        from services.tenants.credentials import seed_path

        seed = seed_path(directory, tenant)
        identity = process_settings(nats_creds=str(seed), tenant=tenant)
        try:
            tenant_bus = await Bus.connect(url, f"{settings.service}-{tenant}", settings=identity)
            base = await asyncio.to_thread(base_run_id_of, tenant, seed)
        except (BusUnavailable, OSError) as exc:
            raise GatewayError(
                503, f"the gateway cannot reach NATS as tenant {tenant}: {exc}", "unavailable"
            ) from None
        log.info("gateway: connected for tenant %s", tenant)
        return Backend(tenant_bus, settings, tenant, base_run_id=base, admission=admission)

    return Tenancy(settings, connect=connect)


async def serve(settings: GatewaySettings, bus: Bus, stop: asyncio.Event) -> int:
    """Serve HTTP until ``stop`` is set; the exit status."""
    codec = await asyncio.to_thread(TextCodec.load, settings.model)
    tenancy = tenancy_for(settings, bus)
    gateway = Gateway(tenancy, settings, codec)
    sessions = asyncio.create_task(gateway.keep_sessions(stop), name="gateway-sessions")
    try:
        await serve_http(build_app(gateway), settings, stop)
    finally:
        sessions.cancel()
        await asyncio.gather(sessions, return_exceptions=True)
        await gateway.futures.close()
        await tenancy.close()
    return 0
