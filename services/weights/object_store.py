"""The ``object_store`` weight transport: each version is an object in ``plexrl-weights``, or,
for a run of tenant ``t``, in that tenant's own store ``plexrl-weights-<t>``.

The trainer writes the stream under ``<run_id>/step_<n>`` (the location) chunk by chunk from the
tensors' own memory (:func:`~services.weights.blobs.write_blob`), never assembled in one buffer;
old versions are deleted, and a restarted trainer finds the versions an earlier one left by
listing the store; a write that fails on the way (the server restarting) is retried with backoff,
and one refused because the store is full waits until there is room.
A replica streams the chunks into a :class:`~services.weights.stream.StreamDecoder` as they
arrive (an adapter is usually one chunk, one direct get), after checking that the object is the
one announced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import nats.errors
from torch import Tensor

from schemas.events import WeightsReady
from schemas.subjects import weights_bucket, weights_object_key
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus
from services.bus.limits import durable_write
from services.weights.blobs import BlobError, delete_blob, stream_blob, write_blob
from services.weights.errors import WeightsError
from services.weights.listing import list_keys
from services.weights.stream import EncodedStream, StreamDecoder
from services.weights.transport import SenderOptions, forget_each

log = logging.getLogger(__name__)

SEND_ATTEMPTS = 20
"""Writes of one version tried before the trainer gives up (about a minute of backoff)."""


class ObjectStoreSender:
    """The trainer's end: objects in the store, listed and deleted by key."""

    name = "object_store"
    in_memory = False

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def start(self) -> None:
        pass

    async def send(
        self,
        run_id: str,
        step: int,
        stream: EncodedStream,
        adapter_config: Any = None,
        *,
        tenant: str = DEFAULT_TENANT,
    ) -> str:
        key = weights_object_key(run_id, step)

        async def store() -> str:
            await write_blob(
                self.bus, key, stream.segments(), stream.digest, bucket=weights_bucket(tenant)
            )
            return key

        def retrying(exc: BaseException, attempt: int, pause: float) -> None:
            log.warning(
                "%s step %d: storing the weights failed (%s); retry %d in %.1fs",
                run_id,
                step,
                exc,
                attempt,
                pause,
            )

        # A server restarting (or a cluster electing a leader) fails the writes for a few
        # seconds; writing the key again replaces whatever part of it landed. A full store
        # pauses the trainer until there is room: dropping the version would lose the step.
        return await durable_write(
            store,
            what=f"{run_id} step {step}: storing the weights",
            attempts=SEND_ATTEMPTS,
            first_delay=0.1,
            max_delay=2.0,
            retry_on=(BlobError, nats.errors.Error),
            give_up=lambda: self.bus.nc.is_closed,
            on_retry=retrying,
            outage_wait=self.bus.outage_wait,
            hint=self.bus.outage_hint,
            stop=self.bus.stopping,
            lost=self.bus.reconnects.lost,
        )

    async def stored(self, run_id: str, *, tenant: str = DEFAULT_TENANT) -> set[int]:
        prefix, bucket = f"{run_id}/step_", weights_bucket(tenant)
        keys = await self.bus.until_available(
            lambda: list_keys(self.bus, bucket=bucket), f"listing the weights in {bucket}"
        )
        return {
            int(key.removeprefix(prefix))
            for key in keys
            if key.startswith(prefix) and key.removeprefix(prefix).isdigit()
        }

    async def forget(
        self, run_id: str, steps: Collection[int], *, tenant: str = DEFAULT_TENANT
    ) -> set[int]:
        bucket = weights_bucket(tenant)
        return await forget_each(
            run_id,
            steps,
            lambda step: delete_blob(self.bus, weights_object_key(run_id, step), bucket=bucket),
            (BlobError, nats.errors.Error),
        )

    async def close(self) -> None:
        pass


class ObjectStoreFetcher:
    """A replica's end: the announced object's chunks into a decoder as they arrive."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def fetch(
        self,
        event: WeightsReady,
        destination: Mapping[str, Tensor] | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
    ) -> dict[str, Tensor]:
        where = f"weights for {event.run_id} step {event.step}"
        touched = False

        async def read() -> StreamDecoder:
            nonlocal touched
            decoder = StreamDecoder(where, event.size_bytes, event.digest, destination)
            try:
                await stream_blob(
                    self.bus,
                    event.location,
                    decoder.feed,
                    expected_size=event.size_bytes,
                    expected_digest=event.digest,
                    bucket=weights_bucket(tenant),
                )
            except BaseException:
                decoder.abandon()
                touched = touched or decoder.touched
                raise
            return decoder

        try:
            # read again from the start while JetStream is unavailable (a cluster without its
            # quorum), for as long as the bus's outage_wait allows
            decoder = await self.bus.until_available(read, f"reading {where}")
        except BaseException as exc:
            if isinstance(exc, nats.errors.Error):
                raise WeightsError(
                    f"{where}: reading {event.location!r} failed: {type(exc).__name__}: {exc}",
                    touched=touched,
                ) from exc
            if isinstance(exc, BlobError | ValueError):
                raise WeightsError(f"{where}: {exc}", touched=touched) from exc
            raise
        # Off the event loop: the rest of the digest may still be hashing.
        return await asyncio.to_thread(decoder.finish)

    async def close(self) -> None:
        pass


def sender(bus: Bus, output_dir: Path, keep_last: int, options: SenderOptions) -> ObjectStoreSender:
    return ObjectStoreSender(bus)


def fetcher(bus: Bus, output_dir: Path | None) -> ObjectStoreFetcher:
    return ObjectStoreFetcher(bus)
