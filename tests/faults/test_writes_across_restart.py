"""The trainer's JetStream writes outlive a nats-server restart.

Found by the soak (tests/faults): the nats-server was killed while the trainer stored a weight
version, the object store's request timed out (``nats: timeout`` from ``write_blob``) and the
trainer exited with status 1 instead of waiting for the server. Storing weights and writing a
progress record now retry with backoff; here both are started while the server is down, stay
pending past one request's timeout, and land once it is back on the same store.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from schemas.records import Progress
from services.bus import Bus, EmbeddedNats
from services.runs.progress import read_progress, write_progress
from services.weights.blobs import get_blob
from services.weights.digest import digest_of
from services.weights.object_store import ObjectStoreSender
from services.weights.stream import EncodedStream

REQUEST_TIMEOUT_S = 5.0
"""nats-py's default timeout of one JetStream request"""


async def test_weights_and_progress_are_written_across_a_server_restart(tmp_path: Path) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "nats")
    server.start()
    bus = await Bus.connect(server.url, "trainer")
    try:
        stream = EncodedStream.from_state_dict({"w": torch.arange(4096, dtype=torch.float32)})
        progress = Progress(step=3, total_tokens=96, total_samples=12)
        server.kill()
        send = asyncio.create_task(ObjectStoreSender(bus).send("run_x", 3, stream))
        put = asyncio.create_task(write_progress(bus, "run_x", progress))
        await asyncio.sleep(REQUEST_TIMEOUT_S + 1.5)
        assert not send.done() and not put.done(), (send, put)
        server.start()
        key = await asyncio.wait_for(send, 60)
        await asyncio.wait_for(put, 60)

        assert key == "run_x/step_3"
        data = await get_blob(bus, key)
        assert len(data) == stream.size
        assert digest_of([data], "blake3") == stream.digest
        stored = await read_progress(bus, "run_x")
        assert stored is not None
        assert (stored.step, stored.total_samples) == (3, 12)
    finally:
        await bus.close()
        server.close()
