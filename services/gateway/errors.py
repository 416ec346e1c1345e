"""The one error every gateway route raises: an HTTP status, a code and a message that says what
was wrong; each API renders it in its own error shape (app.py)."""

from __future__ import annotations


class GatewayError(Exception):
    """A request the gateway cannot serve: ``status`` is the HTTP status, ``code`` a short
    machine-readable reason (``model_not_found``, ``invalid_request``...)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str = "invalid_request",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after
        """seconds a client should wait before retrying (a 429's ``Retry-After``)"""
