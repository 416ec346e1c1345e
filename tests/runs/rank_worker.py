"""One rank of the two-rank run-mirror test (run by test_mirror_ranks.py, not by pytest).

Joins a gloo process group, follows PLEXRL_RUNS with a RunMirror and calls synchronize_state in
a loop, at its own random pace, while the test publishes lifecycle events. Rank 1 starts its
mirror late so its buffer lags rank 0's. When the test says it is done, rank 0 catches up with
the stream and both ranks make one last call. Each rank writes every hook call and every
call's count to ``<out>/rank<N>.json``.

Usage: ``python tests/registry/rank_worker.py NATS_URL OUT_DIR`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


async def main(url: str, out: Path) -> None:
    import torch.distributed as dist

    from services.bus import Bus
    from services.runs import RunMirror

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    bus = await Bus.connect(url, f"rank{rank}", provision_streams=False)

    def broadcast(seq: int) -> int:
        box: list[Any] = [seq if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return int(box[0])

    mirror = RunMirror(bus, max_runs=4, service=f"trainer-rank{rank}", broadcast=broadcast)
    log: list[list[Any]] = []
    mirror.register_deletion_hook(lambda i, r: log.append(["deletion", i, r]))
    mirror.register_creation_hook(lambda i, r: log.append(["creation", i, r]))
    if rank == 1:
        await asyncio.sleep(0.3)
    await mirror.start()
    (out / f"ready{rank}").touch()
    rng = random.Random(rank)
    waited = 0
    while True:
        flag: list[Any] = [(out / "done").exists() if rank == 0 else None]
        dist.broadcast_object_list(flag, src=0)
        if flag[0] and rank == 0:
            await mirror.wait_until_caught_up(30.0)
        behind = mirror.seen_seq
        count = await mirror.synchronize_state()
        # synchronize_state yields to the event loop only to wait for rank 0's sequence
        waited += mirror.seen_seq > behind
        log.append(["sync", count])
        if flag[0]:
            break
        if rank == 1:
            # a training step: compute blocks this rank's event loop, so arriving events pile
            # up unread and rank 0 (whose loop is free) is ahead at the next call
            time.sleep(rng.uniform(0.005, 0.03))
        await asyncio.sleep(rng.uniform(0.0, 0.02))
    runs = {str(i): info.run_id for i, info in mirror.runs.items()}
    result = {"log": log, "runs": runs, "waited": waited}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    await mirror.stop()
    await bus.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
