"""Container health check for the plexrl services: exit status 0 healthy, 1 unhealthy.

The image runs it as its ``HEALTHCHECK``. Healthy means both of:

1. NATS answers at ``PLEXRL_NATS_URL`` (default ``nats://127.0.0.1:4222``; with a
   comma-separated list, any one server): a TCP connection opens and the server's first line
   is its ``INFO`` greeting, so an open port that is not NATS does not count. Every service
   needs NATS for all it does; a container that cannot reach it is doing nothing useful.
2. Only when ``PLEXRL_HEALTH_FILE`` is set: that file was modified less than
   ``PLEXRL_HEALTH_MAX_AGE`` seconds ago (default 120), a heartbeat for a process that
   touches one.

Standard library only, one short connection per server, no NATS client: it runs in well under
a second and adds no connection to the server's client list. Prints one line saying why.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_MAX_AGE = 120.0
TIMEOUT = 2.0

ENV_VARS = ("PLEXRL_NATS_URL", "PLEXRL_HEALTH_FILE", "PLEXRL_HEALTH_MAX_AGE")
"""The environment variables this check reads."""


def nats_addresses(url: str) -> list[tuple[str, int]]:
    """``(host, port)`` of each server in a NATS URL list such as ``nats://a:4222,nats://b``."""
    out = []
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        parsed = urlsplit(part if "://" in part else f"nats://{part}")
        out.append((parsed.hostname or "127.0.0.1", parsed.port or 4222))
    return out


def nats_greets(host: str, port: int, timeout: float = TIMEOUT) -> str | None:
    """``None`` when a NATS server greets us at ``host:port``, else what went wrong."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            greeting = sock.recv(4096)
    except OSError as exc:
        return f"{host}:{port}: {exc.__class__.__name__}: {exc}"
    if not greeting.startswith(b"INFO "):
        return f"{host}:{port}: not a NATS server (first bytes {greeting[:16]!r})"
    return None


def heartbeat_problem(path: str, max_age: float, now: float | None = None) -> str | None:
    """``None`` when ``path`` was modified less than ``max_age`` seconds ago."""
    try:
        age = (time.time() if now is None else now) - os.stat(path).st_mtime
    except OSError as exc:
        return f"heartbeat file {path}: {exc.strerror}"
    if age > max_age:
        return f"heartbeat file {path} is {age:.0f} s old (limit {max_age:.0f} s)"
    return None


def check(environ: Mapping[str, str]) -> tuple[bool, str]:
    url = environ.get("PLEXRL_NATS_URL") or DEFAULT_NATS_URL
    problems = []
    for host, port in nats_addresses(url):
        problem = nats_greets(host, port)
        if problem is None:
            break
        problems.append(problem)
    else:
        return False, f"unhealthy: no NATS server at {url}: " + "; ".join(problems)
    health_file = environ.get("PLEXRL_HEALTH_FILE")
    if health_file:
        try:
            max_age = float(environ.get("PLEXRL_HEALTH_MAX_AGE") or DEFAULT_MAX_AGE)
        except ValueError:
            return False, "unhealthy: PLEXRL_HEALTH_MAX_AGE is not a number of seconds"
        problem = heartbeat_problem(health_file, max_age)
        if problem is not None:
            return False, f"unhealthy: {problem}"
    return True, f"healthy: NATS answers at {url}"


def main() -> int:
    ok, message = check(os.environ)
    print(message)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
