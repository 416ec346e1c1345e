"""Publish a run's weights after an optimizer step: store them, announce them, drop old versions.

The trainer calls :meth:`WeightPublisher.publish` once per run and step, with the run's adapter
(``kind="lora"``, PEFT key names) or, from a trainer without LoRA, the whole model's state dict
(``kind="full"``, Hugging Face key names). Either is encoded as a safetensors stream
(:class:`~services.weights.stream.EncodedStream`: the header, then views of a snapshot of the
tensors, never assembled) and handed to the configured transport's
:class:`~services.weights.transport.WeightSender`, picked by name from
:data:`~services.weights.transport.TRANSPORTS`, which says where replicas find it.

Then a WeightsReady event goes to ``plexrl.weights[.<tenant>].<run_id>`` (message id
``<run_id>/weights/step_<n>/<16 hex digits of the digest>``), carrying the digest
(``blake3:<hex>``, :mod:`services.weights.digest`) and size of the stream, and ``kind="full"``
for full weights (an adapter's event leaves ``kind`` out). Only then are versions older than
the newest ``keep_last`` removed, so neither the disk nor the store grows with the number of
steps, and the version just announced is never among them. A sender that holds its versions in
the trainer's memory (``ucx``, ``collective``) keeps only the version just sent of a full-weight
run, where a whole model is costly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path

import msgspec
from torch import Tensor

from schemas.events import LoraSpec, Transport, WeightKind, WeightsReady
from schemas.subjects import tenant_weights_subject
from schemas.tenant import DEFAULT_TENANT, validate_tenant
from services.bus import Bus
from services.model.peft_io import peft_adapter_config
from services.weights.stream import EncodedStream
from services.weights.transport import SenderOptions, WeightSender, make_sender

log = logging.getLogger(__name__)

_NO_DIGEST = "blake3:" + "0" * 64


class WeightPublisher:
    """Stores and announces the weights of every run on one trainer.

    ``sender`` replaces the one :data:`~services.weights.transport.TRANSPORTS` would build from
    ``options`` (a test's, or one shared with something else)."""

    def __init__(
        self,
        bus: Bus,
        output_dir: Path,
        transport: Transport = "object_store",
        keep_last: int = 3,
        *,
        sender: WeightSender | None = None,
        options: SenderOptions | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(
                f"keep_last must be at least 1 (the version announced), got {keep_last}"
            )
        self.bus = bus
        self.transport: Transport = transport
        self.keep_last = keep_last
        self.sender: WeightSender = sender or make_sender(
            transport, bus, Path(output_dir), keep_last, options or SenderOptions()
        )
        self._started = False
        # Steps of each run that are stored now, found once per (tenant, run) and kept up to
        # date here.
        self._stored: dict[tuple[str, str], set[int]] = {}

    async def start(self) -> None:
        """Start the sender (listen, join the group); idempotent, and done by the first
        :meth:`publish` otherwise. Call it at start-up so a transport that cannot run fails
        there rather than at the first step."""
        if not self._started:
            await self.sender.start()
            self._started = True

    async def close(self) -> None:
        """Stop the sender: replicas can no longer fetch what it held."""
        if self._started:
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
        tenant: str = DEFAULT_TENANT,
    ) -> WeightsReady:
        """Store ``state_dict`` as ``run_id``'s weights at ``step``, announce them, return the
        event.

        ``kind`` says what ``state_dict`` is: ``"lora"``, the run's adapter (``lora`` describes
        it), or ``"full"``, the whole model's state dict (``lora`` is the run's configured
        adapter, announced but unused). The tensors are copied before the first ``await``, so
        the caller may go on training while they are being stored. ``tenant`` owns the run: the
        event goes to its weights subject, the object store transport stores into its store.
        """
        validate_tenant(tenant)
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
        await self.start()
        stored = self._stored.get((tenant, run_id))
        if stored is None:
            stored = self._stored[tenant, run_id] = await self.sender.stored(run_id, tenant=tenant)
        # Encoding hashes every byte once: off the event loop.
        stream = await asyncio.to_thread(EncodedStream.from_state_dict, snapshot)
        config = None
        if not full:
            config = peft_adapter_config(
                lora.rank,
                lora.alpha,
                lora.target_modules,
                base_model_path,
                fan_in_fan_out=lora.fan_in_fan_out,
            )
        location = await self.sender.send(run_id, step, stream, config, tenant=tenant)
        stored.add(step)
        event = msgspec.structs.replace(
            announced, location=location, digest=stream.digest, size_bytes=stream.size
        )
        # The digest is part of the id: a retried publish of the same bytes is dropped, but a
        # step re-trained after a restart (new bytes under the same key) is announced again.
        digest_id = stream.digest.partition(":")[2][:16]
        ack = await self.bus.publish(
            tenant_weights_subject(run_id, tenant),
            event,
            msg_id=f"{run_id}/weights/step_{step}/{digest_id}",
        )
        if ack.duplicate:
            log.info("%s step %d: WeightsReady already announced", run_id, step)
        # A sender that holds each version in memory keeps only the newest of a whole model.
        keep = 1 if full and self.sender.in_memory else self.keep_last
        # Steps above this one (left by a trainer that got further before it restarted from an
        # older checkpoint) are kept: publishing those steps again replaces them.
        older = sorted(s for s in stored if s < step)
        doomed = older[: max(0, len(older) - (keep - 1))]
        if doomed:
            # A version that could not be removed stays listed and is tried after the next step.
            stored.difference_update(await self.sender.forget(run_id, doomed, tenant=tenant))
        return event


def _check_schema(event: WeightsReady) -> None:
    """Raise ValueError now for what every consumer would reject on decoding the event (a run
    id, index or step out of range, a rank of 0), before anything is stored."""
    try:
        msgspec.json.decode(msgspec.json.encode(event), type=WeightsReady)
    except msgspec.ValidationError as exc:
        raise ValueError(f"cannot announce weights for {event.run_id!r}: {exc}") from None
