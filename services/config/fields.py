"""Field types shared by the services' settings models."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator


def _token(max_length: int) -> AfterValidator:
    pattern = re.compile(rf"[A-Za-z0-9_-]{{1,{max_length}}}")

    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{value!r}: use 1-{max_length} letters, digits, '_' or '-'")
        return value

    return AfterValidator(check)


Token = Annotated[str, _token(48)]
"""A name used as one NATS subject token (a consumer, a service): 1-48 letters, digits, _ or -."""
Token64 = Annotated[str, _token(64)]
"""The same, up to 64 characters (a replica name, also sent as a header value)."""
