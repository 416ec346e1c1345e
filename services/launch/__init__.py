"""How a ``plexrl`` command meets NATS: one start-up, serve and shutdown path for every service.

- :func:`run_service`: logging, tracing and metrics, connect (a clear error when nothing
  listens), SIGTERM / SIGINT -> ``asyncio.Event``, serve, drain, exit status.
- :func:`run_client`: the same connection and exit status for a short-lived command.
- :mod:`.faults`: the test-only crash points (``PLEXRL_FAULT``).

Exit statuses shared by every command: 0 a clean stop, 1 NATS unreachable (or another runtime
failure), 2 unusable settings; a service adds its own through ``errors``.
"""

from services.launch.process import fail, run_client, run_service

__all__ = ["fail", "run_client", "run_service"]
