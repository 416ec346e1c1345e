"""Is a service process alive? One answer for containers, probes and operators.

Every service (each command served by :func:`services.launch.run_service`) registers with the
NATS service protocol (``micro``) as ``plexrl-<service>`` once it is connected, with its host,
pid and connection name as metadata, and answers ``$SRV.PING`` from its own event loop until it
stops. ``plexrl health <service>`` sends one ping to ``$SRV.PING.plexrl-<service>`` and waits
for an answer from that service *on this host*: the probe of a container or pod asks about the
process beside it, not about any replica elsewhere. Alive means: the process runs, is connected
to NATS, and its event loop is not stuck. A dead process has no subscription; a frozen or hung
one, or one cut off from NATS, does not answer.

Operators see the same registrations with the ``nats`` tool (``nats micro ls``, ``nats micro
ping plexrl-trainer``). Exit status of ``plexrl health``: 0 healthy, 1 not (with one line on
stdout saying which, and why).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.config import add_common_args

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.micro.service import Service

    from services.bus import Bus

DEFAULT_TIMEOUT_S = 3.0
PING_PREFIX = "$SRV.PING."


def registered_name(service: str) -> str:
    """The service's name in the NATS service protocol: ``plexrl-<service>``."""
    return f"plexrl-{service}"


def this_host() -> str:
    """The name a container's probe shares with the process it checks (the pod or container
    hostname)."""
    return socket.gethostname()


async def announce(bus: Bus, service: str) -> Service | None:
    """Register ``service`` on ``bus`` so that ``plexrl health`` can find this process.

    Not for a process acting for a tenant (``PLEXRL_TENANT``, e.g. ``plexrl orchestrator`` run
    by a tenant): the broker grants tenants no ``$SRV`` subject, and no deployment probes them.
    """
    from importlib.metadata import PackageNotFoundError, version

    from nats.micro import add_service

    from schemas.tenant import DEFAULT_TENANT
    from services.config import process_settings

    if process_settings().tenant != DEFAULT_TENANT:
        return None
    try:
        release = version("plexrl")
    except PackageNotFoundError:
        release = "0.0.0"
    return await add_service(
        bus.nc,
        name=registered_name(service),
        version=release,
        description=f"plexrl {service}",
        metadata={
            "host": this_host(),
            "pid": str(os.getpid()),
            "connection": f"plexrl-{bus.service}",
        },
    )


@dataclass(frozen=True)
class Answer:
    """One process's answer to a ping."""

    host: str
    pid: str
    connection: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} (connection {self.connection})"


async def ping(
    nc: Client, service: str, host: str | None, timeout: float, pid: int | None = None
) -> list[Answer]:
    """Ping every ``plexrl-<service>``; return as soon as one on ``host`` (any host: ``None``)
    with ``pid`` (any: ``None``) answers, else every answer that came within ``timeout``
    seconds. The matching answer, if any, is last."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    answers: list[Answer] = []
    try:
        await nc.publish(PING_PREFIX + registered_name(service), b"", reply=inbox)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except TimeoutError:
                break
            answer = _parse(msg.data)
            if answer is None:
                continue
            answers.append(answer)
            if (host is None or answer.host == host) and (pid is None or answer.pid == str(pid)):
                break
    finally:
        await sub.unsubscribe()
    return answers


def _parse(data: bytes) -> Answer | None:
    try:
        body = json.loads(data)
        meta = body.get("metadata") or {}
    except (ValueError, AttributeError):
        return None
    return Answer(
        str(meta.get("host", "?")), str(meta.get("pid", "?")), str(meta.get("connection", "?"))
    )


async def check(
    url: str, service: str, host: str | None, timeout: float = DEFAULT_TIMEOUT_S
) -> tuple[bool, str]:
    """``(healthy, one line saying why)`` for ``service`` on ``host`` (``None``: anywhere)."""
    from services.bus import Bus, BusUnavailable

    name = registered_name(service)
    where = "any host" if host is None else host
    try:
        bus = await Bus.connect(url, "health", provision_streams=False, connect_timeout=timeout)
    except BusUnavailable as exc:
        return False, f"unhealthy: {exc}"
    try:
        started = time.monotonic()
        answers = await ping(bus.nc, service, host, timeout)
        took_ms = (time.monotonic() - started) * 1000
    finally:
        await bus.close()
    if answers and (host is None or answers[-1].host == host):
        return True, f"healthy: {name} answers: {answers[-1].describe()}, {took_ms:.0f} ms"
    elsewhere = "; ".join(a.describe() for a in answers)
    return False, (
        f"unhealthy: no {name} on {where} answered within {timeout:g} s"
        + (f" (answered elsewhere: {elsewhere})" if elsewhere else "")
    )


# --- the command ---------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "health",
        help="is a service process on this host alive? (exit 0 yes, 1 no)",
        description="Ping SERVICE (registry, trainer, inference, orchestrator, gateway, or the "
        "service name it was given) over NATS and wait for the process on this host to answer "
        "from its event loop: the check of a container's or pod's own process. Prints one line; "
        "exits 0 when it answered, 1 when it did not or NATS cannot be reached.",
    )
    p.add_argument("service", metavar="SERVICE", help="the service's name (its PLEXRL_SERVICE)")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long to wait for the answer (default {DEFAULT_TIMEOUT_S:g})",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--host", help="the host whose process must answer (default: this one)")
    where.add_argument(
        "--any-host", action="store_true", help="any process of SERVICE, wherever it runs"
    )
    add_common_args(p, config=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from schemas.subjects import validate_service_name
    from services.config import SettingsError, nats_url
    from services.launch.process import fail

    try:
        service = validate_service_name(args.service)
        url = nats_url(args)
    except (ValueError, SettingsError) as exc:
        return fail("health", exc)
    # one line of verdict, nothing else: the bus's connection notices are noise here
    logging.getLogger("services.bus").setLevel(logging.CRITICAL)
    host = None if args.any_host else (args.host or this_host())
    ok, message = asyncio.run(check(url, service, host, args.timeout))
    print(message)
    sys.stdout.flush()
    return 0 if ok else 1
