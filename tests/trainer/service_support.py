"""Helpers of the trainer service tests: a registry and a trainer on one NATS server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from schemas.codec import Format, decode
from schemas.events import RolloutBatch, RunSubmitted, WeightsReady
from schemas.records import Progress
from schemas.subjects import SUBMIT, rollout_msg_id, rollouts_subject
from services.bus import Bus
from services.registry.service import Registry
from services.registry.settings import RegistrySettings
from services.runs.progress import read_progress
from services.trainer.service import Trainer, build_model
from services.trainer.settings import TrainerSettings

T = TypeVar("T")


async def eventually(check: Callable[[], Awaitable[T]], timeout: float = 30.0) -> T:
    """Poll ``check`` until it returns a truthy value; fail with the last value after timeout."""
    deadline = time.monotonic() + timeout
    value = await check()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value {value!r})")
        await asyncio.sleep(0.05)
        value = await check()
    return value


async def stream_events(bus: Bus, stream: str, subject: str, event_type: Any) -> list[Any]:
    """Every message of ``stream`` on ``subject``, decoded, in stream order."""
    info = await bus.js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            raw = await bus.js.get_msg(stream, seq)
        except Exception:  # deleted (a per-subject limit)
            continue
        if raw.subject == subject:
            out.append(decode(raw.data or b"", event_type))
    return out


async def weights_events(bus: Bus, run_id: str) -> list[WeightsReady]:
    return await stream_events(bus, "PLEXRL_WEIGHTS", f"plexrl.weights.{run_id}", WeightsReady)


async def submit(bus: Bus, run_id: str, config: dict[str, Any]) -> None:
    await bus.publish(SUBMIT, RunSubmitted(run_id=run_id, config=config), msg_id=f"submit/{run_id}")


async def publish_batch(
    bus: Bus, batch: RolloutBatch, *, fmt: Format | None = None, msg_id: str | None = None
) -> None:
    await bus.publish(
        rollouts_subject(batch.run_id),
        batch,
        msg_id=msg_id or rollout_msg_id(batch.run_id, batch.step),
        fmt=fmt,
    )


async def progress_of(bus: Bus, run_id: str) -> Progress | None:
    return await read_progress(bus, run_id)


class Cluster:
    """A registry and one trainer, each on its own connection, in this process."""

    def __init__(self, url: str, out: Path, model_dir: Path, **trainer_settings: Any) -> None:
        self.url = url
        self.out = out
        self.model_dir = model_dir
        self.trainer_settings = trainer_settings
        self.registry: Registry | None = None
        self.trainer: Trainer | None = None
        self._buses: list[Bus] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> Cluster:
        settings = TrainerSettings(
            **(
                {
                    "model": self.model_dir,
                    "output_dir": self.out,
                    "max_runs": 3,
                    "max_lora_rank": 8,
                    "micro_batch_tokens": 128,
                    "ack_wait": 30.0,
                    "unknown_run_hold": 0.5,
                }
                | self.trainer_settings
            )
        )
        rbus = await Bus.connect(self.url, "registry")
        self._buses.append(rbus)
        # The registry's pool is the trainer's slots, as a deployment sets them.
        self.registry = Registry(
            rbus,
            RegistrySettings(output_dir=self.out, max_runs=settings.max_runs, scan_interval=3600.0),
        )
        await self.registry.start()
        tbus = await Bus.connect(self.url, "trainer")
        self._buses.append(tbus)
        model, lora, pad_id, vocab_size = build_model(settings, torch.device("cpu"))
        self.trainer = Trainer(settings, tbus, model, lora, pad_id=pad_id, vocab_size=vocab_size)
        self._task = asyncio.create_task(self.trainer.run(self._stop))
        return self

    def state(self, run_id: str) -> Any:
        assert self.trainer is not None
        for state in self.trainer.states.values():
            if state.run_id == run_id:
                return state
        return None

    async def stop_trainer(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, 30.0)

    async def close(self) -> None:
        await self.stop_trainer()
        if self.registry is not None:
            await self.registry.stop()
        for bus in self._buses:
            await bus.close()
