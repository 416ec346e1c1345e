"""``plexrl gateway`` as a service: the tokenizer, the backend on the bus, the HTTP server.

The gateway holds no training state: stop it, start it again, and clients carry on after
retrying (runs, adapters and checkpoints live in the registry and the trainer; pending futures
of a stopped gateway are gone, and the SDKs resend what they had not got an answer for).
"""

from __future__ import annotations

import asyncio

from services.bus import Bus
from services.config import process_settings
from services.gateway.app import Gateway, build_app, serve_http
from services.gateway.backend import Backend
from services.gateway.settings import GatewaySettings
from services.gateway.text import TextCodec


async def serve(settings: GatewaySettings, bus: Bus, stop: asyncio.Event) -> int:
    """Serve HTTP until ``stop`` is set; the exit status."""
    codec = await asyncio.to_thread(TextCodec.load, settings.model)
    backend = Backend(bus, settings, process_settings().tenant)
    gateway = Gateway(backend, settings, codec)
    try:
        await serve_http(build_app(gateway), settings, stop)
    finally:
        await gateway.futures.close()
    return 0
