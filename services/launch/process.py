"""Start-up, serving and shutdown of a process that talks to NATS (see the package docstring)."""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from services.bus import Bus, BusUnavailable, StorageFull, setup_tracing, stop_on_signals
from services.bus.tracing import shutdown_tracing
from services.config import process_settings
from services.launch.health import announce
from services.telemetry.metrics import setup_metrics

EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE = 0, 1, 2

Serve = Callable[[Bus, asyncio.Event], Awaitable[int | None]]
Errors = Mapping[type[BaseException], int]


def fail(command: str, message: object, status: int = EXIT_USAGE) -> int:
    """Say what went wrong as ``plexrl <command>: <message>`` on stderr; return ``status``."""
    print(f"plexrl {command}: {message}", file=sys.stderr)
    return status


def run_service(
    command: str,
    serve: Serve,
    *,
    nats_url: str,
    service: str,
    bus_name: str | None = None,
    errors: Errors | None = None,
    provision: bool = True,
) -> int:
    """Run ``serve(bus, stop)`` as service ``service`` until it returns; the exit status.

    ``provision``: create or update the streams and buckets on connecting (False for a process
    that owns none: the gateway).

    ``stop`` is set by SIGTERM or SIGINT; ``serve`` returns once it has stopped cleanly, and the
    connection is drained after it. ``serve`` may return an exit status (None is 0).
    ``errors`` maps exception types raised by ``serve`` to exit statuses (the message goes to
    stderr); an unreachable NATS server is always status 1. While connected, the process answers
    ``plexrl health <service>`` (:mod:`services.launch.health`).
    """
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    setup_tracing(service)
    setup_metrics(service)
    wait = process_settings().connect_wait_s
    try:
        main = _connected(
            serve, nats_url, bus_name or service, True, wait, health=service, provision=provision
        )
        return _run(command, main, errors)
    finally:
        shutdown_tracing()


def run_client(
    command: str,
    body: Callable[[Bus], Awaitable[int | None]],
    *,
    nats_url: str,
    errors: Errors | None = None,
) -> int:
    """Run ``body(bus)`` on a short-lived connection named ``cli``; the exit status.

    No signal handling: Ctrl-C interrupts a client at once.
    """
    # the bus's "disconnected, reconnecting" notice at close is noise in a short-lived client
    logging.getLogger("services.bus.bus").setLevel(logging.ERROR)
    main = _connected(lambda bus, _: body(bus), nats_url, "cli", False, 0.0)
    return _run(command, main, errors)


async def _connected(
    serve: Serve,
    url: str,
    name: str,
    signals: bool,
    wait: float,
    health: str | None = None,
    provision: bool = True,
) -> int:
    stop = stop_on_signals() if signals else asyncio.Event()
    # a service waits out a JetStream outage (a cluster without its quorum), saying so in its
    # log; a client command fails after its quick retries instead
    outage_wait = math.inf if health is not None else 0.0
    bus = await Bus.connect(
        url, name, wait=wait, outage_wait=outage_wait, provision_streams=provision
    )
    if health is not None:
        bus.stopping = stop  # a SIGTERM ends a wait for JetStream too (StoppedWaiting, status 1)
    try:
        announced = await announce(bus, health) if health is not None else None
        try:
            return int(await serve(bus, stop) or EXIT_OK)
        finally:
            if announced is not None and not bus.nc.is_closed:
                await announced.stop()
    finally:
        await bus.close()


def _run(command: str, main: Coroutine[Any, Any, int], errors: Errors | None) -> int:
    # a full store or limits the server cannot reserve: the message says which and what to do
    unavailable = {BusUnavailable: EXIT_UNAVAILABLE, StorageFull: EXIT_UNAVAILABLE}
    statuses: dict[type[BaseException], int] = {**unavailable, **(errors or {})}
    try:
        return asyncio.run(main)
    except tuple(statuses) as exc:
        status = next(s for kind, s in statuses.items() if isinstance(exc, kind))
        return fail(command, exc, status)
