"""How a ``plexrl`` command meets NATS: one start-up, serve and shutdown path for every service.

- :func:`run_service`: logging, tracing and metrics, connect (retried with backoff for
  ``PLEXRL_CONNECT_WAIT_S`` while nothing listens, then a clear error), SIGTERM / SIGINT ->
  ``asyncio.Event``, serve, drain, exit status.
- :func:`run_client`: the same connection and exit status for a short-lived command, which
  fails at once when nothing listens.
- :mod:`.faults`: the test-only crash points (``PLEXRL_FAULT``).

Exit statuses shared by every command: 0 a clean stop, 1 NATS unreachable (or another runtime
failure), 2 unusable settings; a service adds its own through ``errors``.
"""

from services.launch.process import fail, run_client, run_service

__all__ = ["fail", "run_client", "run_service"]
