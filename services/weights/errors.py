"""The one error every weight transport raises for announced weights it cannot deliver."""

from __future__ import annotations


class WeightsError(RuntimeError):
    """Announced weights that cannot be used; the message says which run, step and why.

    ``touched`` says whether a ``destination`` handed to the loader or a fetcher (a model's own
    parameters, receiving full weights in place) may have been partly overwritten before the
    failure: True once bytes could have landed in it (a digest mismatch found after the data
    arrived, a transfer cut off half way), False when nothing was written (a bad header, a size,
    name, dtype or shape mismatch seen from the header, a refused connection, a missing object).
    A caller that finds it True must not serve those tensors until a good version lands.
    """

    def __init__(self, message: str, *, touched: bool = False) -> None:
        super().__init__(message)
        self.touched = touched


class TransportUnavailable(WeightsError):
    """The configured weight transport cannot run here (missing package, port taken): a
    configuration error to report at start-up, not at the first step."""
