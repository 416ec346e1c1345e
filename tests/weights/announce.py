"""The announcement of a stream that a direct transport's sender sent, as the publisher makes it."""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.events import LoraSpec, WeightsReady
from services.weights.stream import EncodedStream


def announcement(
    run_id: str,
    step: int,
    transport: Any,
    location: str,
    stream: EncodedStream,
    lora: LoraSpec,
    kind: Any = msgspec.UNSET,
) -> WeightsReady:
    return WeightsReady(
        run_id=run_id,
        idx=0,
        step=step,
        transport=transport,
        location=location,
        digest=stream.digest,
        size_bytes=stream.size,
        lora=lora,
        kind=kind,
    )
