"""The run-id rule, stated once.

A run id names a directory under ``output_dir`` and a NATS subject token, so it must be safe
in both: ``run_`` followed by 1 to 64 letters, digits, ``_`` or ``-``. No dots, slashes,
wildcards or whitespace can reach a path or a subject.
"""

from __future__ import annotations

import re

RUN_ID_PATTERN = r"^run_[A-Za-z0-9_-]{1,64}$"
_RUN_ID_RE = re.compile(RUN_ID_PATTERN)


class InvalidRunId(ValueError):
    """A string that is not a legal run id."""


def is_valid_run_id(value: object) -> bool:
    return isinstance(value, str) and _RUN_ID_RE.fullmatch(value) is not None


def validate_run_id(value: object) -> str:
    """Return ``value`` if it is a legal run id, else raise :class:`InvalidRunId`."""
    if not is_valid_run_id(value):
        shown = (
            repr(value)
            if not isinstance(value, str) or len(value) <= 80
            else repr(value[:80]) + "..."
        )
        raise InvalidRunId(
            f"illegal run id {shown}: a run id is 'run_' followed by 1-64 letters, digits, '_' or '-'"
        )
    assert isinstance(value, str)
    return value


def in_sweep(run_id: str, sweep_name: str) -> bool:
    """Whether ``run_id`` is a run of the sweep ``sweep_name``: ``run_<name>`` or
    ``run_<name>-...`` (sweep names hold no ``-``, so no sweep's runs match another's name)."""
    return run_id == f"run_{sweep_name}" or run_id.startswith(f"run_{sweep_name}-")
