"""What a client sees of its NATS servers while JetStream does not answer: which accept a TCP
connection, and what that says (no server up, no quorum, a leader being elected), for the one
line a waiting operation logs (:func:`services.bus.retry.with_backoff`'s ``hint``)."""

from __future__ import annotations

import asyncio
from urllib.parse import urlparse

from services.bus.retry import Servers


async def any_reachable(servers: list[str], timeout: float) -> bool:
    """Whether any of ``servers`` accepts a TCP connection within ``timeout`` seconds."""
    for server in servers:
        parsed = urlparse(server if "://" in server else f"nats://{server}")
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except (OSError, TimeoutError):
            continue
        writer.close()
        return True
    return False


async def reachable(servers: list[str], timeout: float = 1.0) -> tuple[int, int]:
    """How many of ``servers`` accept a TCP connection now, and how many there are."""
    answers = await asyncio.gather(*(any_reachable([s], timeout) for s in servers))
    return sum(answers), len(servers)


async def outage_hint(servers: list[str]) -> Servers:
    """What ``servers`` say while JetStream does not answer (see the module docstring)."""
    up, of = await reachable(servers)
    if of == 0:
        return Servers("JetStream is unavailable (no quorum, or no server reachable?)", False)
    if up == 0:
        return Servers(
            f"JetStream is unavailable: none of the {of} NATS servers is reachable", True
        )
    if of > 1 and up <= of // 2:
        return Servers(
            f"JetStream has no quorum: only {up} of {of} NATS servers reachable "
            "(a replicated stream needs a majority of its servers)",
            True,
        )
    return Servers(
        f"JetStream is unavailable ({up} of {of} NATS servers reachable: electing a "
        "leader, or the cluster lost its quorum?)",
        False,
    )
