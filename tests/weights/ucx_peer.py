"""The other process of the UCX tests: a replica that fetches, or a trainer that dies mid-send.

Usage:
    ucx_peer.py fetch EVENT_JSON
        Fetch the WeightsReady in EVENT_JSON with a fresh UcxWeightClient; print one JSON line:
        the digest of what was received, encoded again, and its number of tensors.
    ucx_peer.py serve NATS_URL RUN_ID OUTPUT_DIR BIG_MB
        A trainer: publish RUN_ID's adapter at step 1 over ucx and print READY; on a line on
        stdin publish a BIG_MB adapter at step 2, whose transfer stops after its first piece:
        it prints MID once a replica is receiving, then waits to be killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import torch

from schemas.events import LoraSpec, WeightsReady
from services.bus import Bus
from services.weights import EncodedStream, WeightPublisher
from services.weights.buckets import bucket_pieces
from services.weights.ucx import UcxWeightClient, UcxWeightServer, _tag

RANK = 4
LORA = LoraSpec(rank=RANK, alpha=8.0, target_modules=["q_proj"])


def adapter(seed: int, fan_in: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return {
        f"{prefix}.lora_A.weight": torch.randn(RANK, fan_in, generator=g),
        f"{prefix}.lora_B.weight": torch.randn(8, RANK, generator=g),
    }


class StallingServer(UcxWeightServer):
    """Sends the first data piece of a stream of more than ``stall_above`` bytes, then stops."""

    stall_above = 1 << 62

    async def _send_stream(self, ep: Any, request_id: int, stream: EncodedStream) -> None:
        if stream.size <= self.stall_above:
            return await super()._send_stream(ep, request_id, stream)
        await ep.send(memoryview(stream.header), tag=_tag(request_id, 1))
        first, _ = next(bucket_pieces(stream.data_segments(), self.chunk_bytes, sending=True))
        await ep.send(first, tag=_tag(request_id, 2))
        print("MID", flush=True)
        await asyncio.Event().wait()


async def fetch(event_json: str) -> None:
    event = msgspec.json.decode(event_json, type=WeightsReady)
    client = UcxWeightClient(stall_timeout=20.0)
    state = await client.fetch(event)
    again = EncodedStream.from_state_dict(state)
    print(json.dumps({"digest": again.digest, "tensors": len(state)}), flush=True)
    await client.close()


async def serve(url: str, run_id: str, out: Path, big_mb: int) -> None:
    bus = await Bus.connect(url, "trainer")
    server = StallingServer(chunk_bytes=4 << 20)
    server.stall_above = 1 << 20
    publisher = WeightPublisher(bus, out, transport="ucx", sender=server)
    await publisher.publish(run_id, 0, 1, adapter(1, 16), LORA)
    print("READY", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    big = adapter(2, (big_mb << 20) // (4 * RANK))
    await publisher.publish(run_id, 0, 2, big, LORA)
    await asyncio.Event().wait()


if __name__ == "__main__":
    match sys.argv[1:]:
        case ["fetch", event_json]:
            asyncio.run(fetch(event_json))
        case ["serve", url, run_id, out, big_mb]:
            asyncio.run(serve(url, run_id, Path(out), int(big_mb)))
        case _:
            sys.exit(__doc__)
