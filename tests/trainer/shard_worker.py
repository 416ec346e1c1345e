"""One rank of the sharded-trainer test (run as a subprocess with the torchrun variables set).

Usage: shard_worker.py MODEL_DIR SINGLE_CKPTS FSDP_CKPTS RESULT_FILE FIRST STEPS MORE

1. ``fsdp``: resume every run of the scenario from the checkpoints one process wrote under
   SINGLE_CKPTS (resuming re-shards), train scenario steps FIRST..FIRST+STEPS-1, and write the
   checkpoints rank 0 gathers under FSDP_CKPTS;
2. ``dp`` and ``hybrid`` (shard groups of one rank: replicated, through HSDP): each resumes
   from those checkpoints and trains MORE steps.

Rank 0 saves what each phase ended with to RESULT_FILE.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
from shard_scenario import MAX_RANK, MAX_RUNS, RUNS, Scenario, summary
from torch.distributed.tensor import DTensor

from services.trainer.checkpoint import latest_checkpoint, save_checkpoint
from services.trainer.distributed import close_ranks, init_ranks
from services.trainer.service import build_model
from services.trainer.settings import TrainerSettings


def resume(scenario: Scenario, ckpts: Path) -> None:
    found = None
    if scenario.ranks.is_main:
        found = {run_id: latest_checkpoint(ckpts, run_id) for run_id in RUNS}
    scenario.add_runs(scenario.ranks.broadcast_object(found))


def held_fraction(model: torch.nn.Module) -> dict[str, float]:
    """The fraction of the base model's and of the slots' parameters this rank holds."""
    held = {"base": [0, 0], "slots": [0, 0]}
    for name, p in model.named_parameters():
        part = held["slots" if ".lora_" in name else "base"]
        part[0] += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        part[1] += p.numel()
    return {k: mine / total for k, (mine, total) in held.items()}


def main(
    model_dir: Path, single: Path, sharded: Path, result: Path, first: int, steps: int, more: int
) -> None:
    ranks = init_ranks("cpu", "fsdp")
    out = {}
    for sharding in ("fsdp", "dp", "hybrid"):
        these = replace(ranks, sharding=sharding)
        settings = TrainerSettings(
            model=model_dir,
            max_runs=MAX_RUNS,
            max_lora_rank=MAX_RANK,
            sharding=sharding,
            shard_ranks=1,
        )
        model, lora, _, _ = build_model(settings, torch.device("cpu"), these)
        scenario = Scenario(model, lora, these)
        if sharding == "fsdp":
            resume(scenario, single)
            scenario.train(range(first, first + steps))
        else:
            resume(scenario, sharded)
            scenario.train(range(first + steps, first + steps + more))
        if ranks.is_main:
            checkpoints = scenario.checkpoints()
            if sharding == "fsdp":
                for run_id, ckpt in checkpoints.items():
                    save_checkpoint(sharded, run_id, ckpt, keep=2)
            out[sharding] = {
                "runs": summary(checkpoints),
                "refused": scenario.refused,
                "held": held_fraction(model),
            }
        scenario.pool.shutdown()
    if ranks.is_main:
        torch.save(out, result)
    close_ranks(ranks)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{os.environ.get('RANK')} %(message)s"
    )
    faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where, in the test's log
    torch.set_num_threads(1)
    model_dir, single, sharded, result, first, steps, more = sys.argv[1:8]
    main(
        Path(model_dir),
        Path(single),
        Path(sharded),
        Path(result),
        int(first),
        int(steps),
        int(more),
    )
