"""Publish a run's weights after an optimizer step: store them, announce them, drop old versions.

The trainer calls :meth:`WeightPublisher.publish` once per run and step, with the run's adapter
(``kind="lora"``, PEFT key names) or, from a trainer without LoRA, the whole model's state dict
(``kind="full"``, Hugging Face key names). Either is stored as safetensors by the configured
transport:

- ``object_store``: key ``<run_id>/step_<n>`` in ``plexrl-weights``; full weights are written
  chunk by chunk from the tensors' own memory, never assembled in one buffer;
- ``filesystem``: ``{output_dir}/<run_id>/broadcast/step_<n>/``, written atomically: a PEFT
  directory for an adapter, which vLLM and PEFT load as it is, or ``model.safetensors``
  (:data:`~services.model.peft_io.FULL_WEIGHTS_FILE`) for full weights;
- ``ucx`` and ``collective``: handed as an :class:`~services.weights.stream.EncodedStream` (the
  safetensors bytes as views of the snapshot, never assembled) to a
  :class:`~services.weights.transport.WeightSender`, which says where replicas find it: a
  :class:`~services.weights.ucx.UcxWeightServer` built here for ``ucx``, the caller's
  ``CollectiveSender`` for ``collective``.

Then a WeightsReady event goes to ``plexrl.weights.<run_id>`` (message id
``<run_id>/weights/step_<n>``), carrying the sha256 digest and size of the stored safetensors
bytes, and ``kind="full"`` for full weights (an adapter's event leaves ``kind`` out, so its bytes
are what they always were). Only then are versions older than the newest ``keep_last`` removed,
so neither the disk nor the store grows with the number of steps, and the version just announced
is never among them. A direct sender holds its versions in the trainer's memory, where a whole
model is costly: of a full-weight run it keeps only the version just sent.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import msgspec
import nats.errors
from torch import Tensor

from schemas.events import LoraSpec, WeightKind, WeightsReady
from schemas.subjects import weights_object_key, weights_subject
from services.bus import Bus
from services.model.peft_io import (
    ADAPTER_WEIGHTS,
    adapter_to_bytes,
    sha256_digest,
    write_full_weights_dir,
    write_peft_dir,
)
from services.weights.object_store import BlobError, delete_blob, list_keys, write_blob
from services.weights.stream import EncodedStream
from services.weights.transport import WeightSender

log = logging.getLogger(__name__)

PublishTransport = Literal["object_store", "filesystem", "ucx", "collective"]
_STEP_DIR = re.compile(r"^step_(\d+)$")
_NO_DIGEST = "sha256:" + "0" * 64


class WeightPublisher:
    """Stores and announces the weights of every run on one trainer."""

    def __init__(
        self,
        bus: Bus,
        output_dir: Path,
        transport: PublishTransport = "object_store",
        keep_last: int = 3,
        *,
        sender: WeightSender | None = None,
        ucx_host: str = "127.0.0.1",
        ucx_port: int = 0,
    ) -> None:
        if transport not in ("object_store", "filesystem", "ucx", "collective"):
            raise ValueError(
                f"weight transport {transport!r} cannot be published by this build: use "
                "'object_store', 'filesystem', 'ucx' or 'collective'"
            )
        if keep_last < 1:
            raise ValueError(
                f"keep_last must be at least 1 (the version announced), got {keep_last}"
            )
        if sender is None and transport == "ucx":
            from services.weights.ucx import UcxWeightServer

            sender = UcxWeightServer(ucx_host, ucx_port, keep_last)
        if sender is None and transport == "collective":
            raise ValueError(
                "weight transport 'collective' needs its sender: pass "
                "sender=CollectiveSender(bus, host, port) from services.weights.collective"
            )
        if sender is not None and transport in ("object_store", "filesystem"):
            raise ValueError(f"weight transport {transport!r} takes no sender")
        self.sender = sender
        self._started = False
        self.bus = bus
        # Absolute, because the location goes to other processes with other working directories.
        self.output_dir = Path(output_dir).absolute()
        self.transport: PublishTransport = transport
        self.keep_last = keep_last
        # Steps of each run that are stored now, found once per run and kept up to date here.
        self._stored: dict[str, set[int]] = {}

    async def start(self) -> None:
        """Start the sender (listen, join the group); idempotent, and done by the first
        :meth:`publish` otherwise. Call it at start-up so a transport that cannot run fails
        there rather than at the first step."""
        if self.sender is not None and not self._started:
            await self.sender.start()
            self._started = True

    async def close(self) -> None:
        """Stop the sender: replicas can no longer fetch what it held."""
        if self.sender is not None and self._started:
            self._started = False
            await self.sender.close()

    async def publish(
        self,
        run_id: str,
        idx: int,
        step: int,
        state_dict: Mapping[str, Tensor],
        lora: LoraSpec,
        base_model_path: str = "",
        *,
        kind: WeightKind = "lora",
    ) -> WeightsReady:
        """Store ``state_dict`` as ``run_id``'s weights at ``step``, announce them, return the
        event.

        ``kind`` says what ``state_dict`` is: ``"lora"``, the run's adapter (``lora`` describes
        it), or ``"full"``, the whole model's state dict (``lora`` is the run's configured
        adapter, announced but unused). The tensors are copied before the first ``await``, so
        the caller may go on training while they are being stored.
        """
        if kind not in ("lora", "full"):
            raise ValueError(f"kind must be 'lora' or 'full', got {kind!r}")
        full = kind == "full"
        announced = WeightsReady(
            run_id=run_id,
            idx=idx,
            step=step,
            transport=self.transport,
            location="",
            digest=_NO_DIGEST,
            size_bytes=0,
            lora=lora,
            kind="full" if full else msgspec.UNSET,
        )
        _check_schema(announced)
        snapshot = {k: t.detach().to("cpu", copy=True) for k, t in state_dict.items()}
        stored = await self._stored_steps(run_id)
        if self.sender is not None:
            location, digest, size = await self._send(run_id, step, snapshot)
        elif full:
            location, digest, size = await self._store_stream(run_id, step, snapshot)
        elif self.transport == "object_store":
            location, digest, size = await self._put_object(run_id, step, snapshot)
        else:
            location, digest, size = await self._write_dir(
                run_id, step, snapshot, lora, base_model_path
            )
        stored.add(step)
        event = msgspec.structs.replace(
            announced, location=location, digest=digest, size_bytes=size
        )
        # The digest is part of the id: a retried publish of the same bytes is dropped, but a
        # step re-trained after a restart (new bytes under the same key) is announced again.
        ack = await self.bus.publish(
            weights_subject(run_id), event, msg_id=f"{run_id}/weights/step_{step}/{digest[7:23]}"
        )
        if ack.duplicate:
            log.info("%s step %d: WeightsReady already announced", run_id, step)
        # A sender holds each version it keeps in memory: of a whole model, only the newest.
        keep = 1 if full and self.sender is not None else self.keep_last
        await self._collect_garbage(run_id, step, stored, keep)
        return event

    async def _send(
        self, run_id: str, step: int, snapshot: dict[str, Tensor]
    ) -> tuple[str, str, int]:
        assert self.sender is not None
        await self.start()
        # Encoding hashes every byte once: off the event loop.
        stream = await asyncio.to_thread(EncodedStream.from_state_dict, snapshot)
        location = await self.sender.send(run_id, step, stream)
        return location, stream.digest, stream.size

    async def _store_stream(
        self, run_id: str, step: int, snapshot: dict[str, Tensor]
    ) -> tuple[str, str, int]:
        """Full weights to the object store or a broadcast directory, from the tensors' memory."""
        # Encoding hashes every byte once: off the event loop.
        stream = await asyncio.to_thread(EncodedStream.from_state_dict, snapshot)
        if self.transport == "object_store":
            key = weights_object_key(run_id, step)
            await write_blob(self.bus, key, stream.segments(), stream.digest)
            return key, stream.digest, stream.size
        path = self._broadcast_dir(run_id) / f"step_{step}"
        # The stream was hashed from the very views the file is written from.
        await asyncio.to_thread(write_full_weights_dir, path, stream.segments())
        return str(path), stream.digest, stream.size

    async def _put_object(
        self, run_id: str, step: int, snapshot: dict[str, Tensor]
    ) -> tuple[str, str, int]:
        data, digest = await asyncio.to_thread(_serialise, snapshot)
        key = weights_object_key(run_id, step)
        await write_blob(self.bus, key, data, digest)
        return key, digest, len(data)

    async def _write_dir(
        self,
        run_id: str,
        step: int,
        snapshot: dict[str, Tensor],
        lora: LoraSpec,
        base_model_path: str,
    ) -> tuple[str, str, int]:
        path = self._broadcast_dir(run_id) / f"step_{step}"

        def write() -> tuple[str, int]:
            write_peft_dir(
                path, snapshot, lora.rank, lora.alpha, lora.target_modules, base_model_path
            )
            # The digest covers the file as written, read back, rather than a second
            # serialisation that is only assumed to produce the same bytes.
            data = (path / ADAPTER_WEIGHTS).read_bytes()
            return sha256_digest(data), len(data)

        digest, size = await asyncio.to_thread(write)
        return str(path), digest, size

    def _broadcast_dir(self, run_id: str) -> Path:
        return self.output_dir / run_id / "broadcast"

    async def _stored_steps(self, run_id: str) -> set[int]:
        """The steps of ``run_id`` in the store, listed once, e.g. left by an earlier trainer."""
        stored = self._stored.get(run_id)
        if stored is None:
            if self.sender is not None:
                stored = set()  # a sender holds only what this publisher gave it
            elif self.transport == "object_store":
                stored = await self._listed_objects(run_id)
            else:
                stored = self._listed_dirs(run_id)
            self._stored[run_id] = stored
        return stored

    async def _listed_objects(self, run_id: str) -> set[int]:
        prefix = f"{run_id}/step_"
        return {
            int(key.removeprefix(prefix))
            for key in await list_keys(self.bus)
            if key.startswith(prefix) and key.removeprefix(prefix).isdigit()
        }

    def _listed_dirs(self, run_id: str) -> set[int]:
        root = self._broadcast_dir(run_id)
        if not root.is_dir():
            return set()
        return {
            int(m.group(1))
            for entry in root.iterdir()
            if entry.is_dir() and (m := _STEP_DIR.match(entry.name))
        }

    async def _collect_garbage(
        self, run_id: str, current: int, stored: set[int], keep: int
    ) -> None:
        """Remove all but the newest ``keep`` versions up to ``current``.

        Steps above ``current`` (left by a trainer that got further before it restarted from an
        older checkpoint) are kept: publishing those steps again replaces them.
        """
        older = sorted(s for s in stored if s < current)
        doomed = older[: max(0, len(older) - (keep - 1))]
        if self.sender is not None and doomed:
            await self.sender.forget(run_id, doomed)
            stored.difference_update(doomed)
            return
        for step in doomed:
            try:
                if self.transport == "object_store":
                    await delete_blob(self.bus, weights_object_key(run_id, step))
                else:
                    await asyncio.to_thread(
                        _remove_dir, self._broadcast_dir(run_id) / f"step_{step}"
                    )
            except (OSError, BlobError, nats.errors.Error) as exc:
                # The new version is announced already; a version that could not be removed
                # stays listed and is tried again after the next step.
                log.warning("%s: could not remove weights of step %d: %s", run_id, step, exc)
                continue
            stored.discard(step)


def _check_schema(event: WeightsReady) -> None:
    """Raise ValueError now for what every consumer would reject on decoding the event (a run
    id, index or step out of range, a rank of 0), before anything is stored."""
    try:
        msgspec.json.decode(msgspec.json.encode(event), type=WeightsReady)
    except msgspec.ValidationError as exc:
        raise ValueError(f"cannot announce weights for {event.run_id!r}: {exc}") from None


def _serialise(snapshot: dict[str, Tensor]) -> tuple[bytes, str]:
    data = adapter_to_bytes(snapshot)
    return data, sha256_digest(data)


def _remove_dir(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:  # already gone is what was wanted
        pass
