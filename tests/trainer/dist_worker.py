"""One rank of the two-rank trainer test (run as a subprocess with the torchrun variables set).

Usage: dist_worker.py NATS_URL MODEL_DIR OUTPUT_DIR RESULT_FILE STEPS

Every rank runs the real trainer service; rank 0 asks to stop once every run it holds has taken
STEPS steps (the stop reaches the other ranks at the same step boundary), and then each rank
saves every run's adapter slot to RESULT_FILE, so the test can compare the ranks bit for bit.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import sys
from pathlib import Path

import torch

from services.bus import Bus
from services.trainer.distributed import close_ranks, init_ranks
from services.trainer.service import Trainer, build_model
from services.trainer.settings import TrainerSettings


async def main(url: str, model_dir: Path, out: Path, result: Path, steps: int) -> None:
    ranks = init_ranks("cpu")
    settings = TrainerSettings(
        model=model_dir,
        output_dir=out,
        max_runs=2,
        max_lora_rank=4,
        micro_batch_tokens=64,
        collect_ms=200.0,
    )
    bus = await Bus.connect(url, f"trainer-{ranks.rank}")
    model, lora, pad_id, vocab_size = build_model(settings, torch.device("cpu"))
    trainer = Trainer(settings, bus, model, lora, pad_id=pad_id, vocab_size=vocab_size, ranks=ranks)
    stop = asyncio.Event()

    async def watch() -> None:
        while ranks.is_main:
            states = list(trainer.states.values())
            if len(states) == 2 and all(s.progress.step >= steps for s in states):
                stop.set()
                return
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    await trainer.run(stop)
    watcher.cancel()
    torch.save(
        {
            state.run_id: {"idx": state.idx, "adapter": lora.slot_state_dict(state.idx)}
            for state in trainer.states.values()
        }
        | {"_steps": trainer.num_steps},
        result,
    )
    await bus.close()
    close_ranks(ranks)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{os.environ.get('RANK')} %(message)s"
    )
    faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where, in the test's log
    torch.set_num_threads(1)
    url, model_dir, out, result, steps = sys.argv[1:6]
    asyncio.run(main(url, Path(model_dir), Path(out), Path(result), int(steps)))
