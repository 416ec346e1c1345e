"""Helpers of the registry tests: files, stream readers and polling."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from schemas.codec import decode
from schemas.events import InvalidMessage, ServiceError
from schemas.records import RunRecord
from schemas.subjects import ERRORS_STREAM, KV_REGISTRY, RUNS_STREAM
from services.bus import Bus
from services.registry.service import Registry
from services.runs.table import read_table

T = TypeVar("T")

VALID_TOML = """\
env = "reverse"
max_steps = 20
batch_size = 4
group_size = 4

[model.lora]
rank = 8
alpha = 16
"""


async def stop_registry(registry: Registry) -> None:
    await registry.stop()
    await registry.bus.close()


def write_orch(out: Path, run_id: str, text: str = VALID_TOML) -> Path:
    path = out / run_id / "control" / "orch.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


async def stream_messages(bus: Bus, stream: str = RUNS_STREAM) -> list[tuple[str, bytes]]:
    """(subject, payload) of every message in ``stream``, in order."""
    info = await bus.js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            raw = await bus.js.get_msg(stream, seq)
        except Exception:  # a deleted message
            continue
        out.append((raw.subject or "", raw.data or b""))
    return out


async def events_on(bus: Bus, subject: str, event_type: Any) -> list[Any]:
    return [decode(d, event_type) for s, d in await stream_messages(bus) if s == subject]


async def error_reports(bus: Bus, service: str = "registry") -> list[InvalidMessage | ServiceError]:
    subject = f"plexrl.errors.{service}"
    return [
        decode(d, InvalidMessage | ServiceError)
        for s, d in await stream_messages(bus, ERRORS_STREAM)
        if s == subject
    ]


async def table(bus: Bus) -> dict[str, RunRecord]:
    return await read_table(await bus.js.key_value(KV_REGISTRY))


async def eventually(check: Callable[[], Awaitable[T]], timeout: float = 10.0) -> T:
    """Poll ``check`` until it returns a truthy value; fail with the last value after timeout."""
    deadline = time.monotonic() + timeout
    value = await check()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value {value!r})")
        await asyncio.sleep(0.05)
        value = await check()
    return value
