"""The one error every weight transport raises for an announced adapter it cannot deliver."""

from __future__ import annotations


class WeightsError(RuntimeError):
    """An announced adapter that cannot be used; the message says which run, step and why."""


class TransportUnavailable(WeightsError):
    """The configured weight transport cannot run here (missing package, port taken): a
    configuration error to report at start-up, not at the first step."""
