"""Test-only fault injection: exit the process at a named point, as SIGKILL would.

``PLEXRL_FAULT=<point>[@<run_id>][:<at>]`` makes the process exit with status 137 right after
``point`` (for ``run_id`` if given; at ``at`` if given: the step for the trainer's points, the
status just written for the registry's). The crash-recovery tests use it to kill a service
between two writes. Points:

- trainer (services/trainer/commit.py): ``trainer.train``, ``trainer.checkpoint``,
  ``trainer.publish``, ``trainer.progress``, ``trainer.ack``;
- registry (services/registry/ledger.py, service.py): ``registry.orch_toml``,
  ``registry.error_txt``, ``registry.evicted_txt``, ``registry.kv``, ``registry.publish``;
- orchestrator (services/orchestrator/step.py): ``orchestrator.publish`` (a step's batch is on
  the stream, its metrics line not yet written; ``at`` is the step).

Unset (the default), every point costs one settings read.
"""

from __future__ import annotations

import logging
import os

from services.config import env_name, process_settings

log = logging.getLogger(__name__)


def crash_point(point: str, run_id: str, at: object = "") -> None:
    """Exit at once with status 137 if ``PLEXRL_FAULT`` names this point."""
    spec = process_settings().fault
    if not spec:
        return
    rest, _, want_at = spec.partition(":")
    name, _, target = rest.partition("@")
    if name == point and target in ("", run_id) and want_at in ("", str(at)):
        log.critical("%s=%s: exiting at %s for %s (%s)", env_name("fault"), spec, point, run_id, at)
        logging.shutdown()
        os._exit(137)
