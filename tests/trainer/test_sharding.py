"""Two gloo ranks sharding the model (FSDP2) train as one process does, and share checkpoints.

The scenario (shard_scenario.py: two RolloutBatch runs, one with a KL penalty, a run trained by
commands, micro-batches that do not split evenly over the ranks, one refused step) runs in this
process and on two sharded ranks; every run's adapter and AdamW moments must agree to 1e-5. The
ranks resume from checkpoints this process wrote, and what they write is resumed by ``dp``
ranks, by ``hybrid`` ranks and by this process again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from shard_scenario import BUDGET, MAX_RANK, MAX_RUNS, RUNS, Scenario, summary
from trainer_support import make_batch

from services.bus import free_port
from services.trainer.checkpoint import latest_checkpoint, save_checkpoint
from services.trainer.packer import pack_step
from services.trainer.service import build_model
from services.trainer.settings import TrainerSettings

BEFORE, SHARDED, AFTER = 2, 3, 2
"""scenario steps trained here first, then on the sharded ranks, then by each resumer"""


def _scenario(tiny_dir: Path) -> Scenario:
    settings = TrainerSettings(model=tiny_dir, max_runs=MAX_RUNS, max_lora_rank=MAX_RANK)
    model, lora, _, _ = build_model(settings, torch.device("cpu"))
    return Scenario(model, lora)


def _ranks(tmp_path: Path, args: list[str]) -> None:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).parents[2]), str(Path(__file__).parent)]
            ),
        }
        log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        cmd = [sys.executable, str(Path(__file__).with_name("shard_worker.py")), *args]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(150))
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    logs = "".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], logs


def _assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys() == set(RUNS)
    for run_id, want in expected.items():
        have = got[run_id]
        assert have["step"] == want["step"], run_id
        for part in ("adapter", "moments"):
            assert have[part].keys() == want[part].keys(), (run_id, part)
            for key, value in want[part].items():
                torch.testing.assert_close(
                    have[part][key], value, atol=1e-5, rtol=1e-4, msg=f"{run_id} {part} {key}"
                )


def test_sharded_ranks_train_as_one_process_and_share_its_checkpoints(tmp_path, tiny_dir):
    single, sharded, result = tmp_path / "single", tmp_path / "sharded", tmp_path / "result.pt"
    reference = _scenario(tiny_dir)
    reference.add_runs({})
    first = [(RUNS[r], make_batch(r, 0, num_samples=5)) for r in ("run_a", "run_b")]
    micro_batches = pack_step(first, token_budget=BUDGET, pad_id=0, vocab_size=90).micro_batches
    assert len(micro_batches) % 2 == 1, "the scenario must leave one rank a micro-batch short"

    reference.train(range(BEFORE))
    for run_id, ckpt in reference.checkpoints().items():
        save_checkpoint(single, run_id, ckpt, keep=2)
    reference.train(range(BEFORE, BEFORE + SHARDED))
    at_handover = summary(reference.checkpoints())
    refused = list(reference.refused)
    assert refused == [("run_b", 3)]
    reference.train(range(BEFORE + SHARDED, BEFORE + SHARDED + AFTER))
    final = summary(reference.checkpoints())

    _ranks(
        tmp_path,
        [
            str(tiny_dir),
            str(single),
            str(sharded),
            str(result),
            *map(str, (BEFORE, SHARDED, AFTER)),
        ],
    )
    got = torch.load(result)
    # fsdp holds half of every parameter (a tensor of odd length a row more or less); a shard
    # group of one rank holds all of it, as dp does
    assert 0.45 < got["fsdp"]["held"]["base"] < 0.55
    assert 0.45 < got["fsdp"]["held"]["slots"] < 0.55
    assert got["dp"]["held"] == got["hybrid"]["held"] == {"base": 1.0, "slots": 1.0}
    assert got["fsdp"]["refused"] == refused
    _assert_same(got["fsdp"]["runs"], at_handover)
    _assert_same(got["dp"]["runs"], final)
    _assert_same(got["hybrid"]["runs"], final)

    # what the sharded ranks wrote is an ordinary checkpoint: one process resumes from it
    back = _scenario(tiny_dir)
    back.add_runs({run_id: latest_checkpoint(sharded, run_id) for run_id in RUNS})
    back.train(range(BEFORE + SHARDED, BEFORE + SHARDED + AFTER))
    _assert_same(summary(back.checkpoints()), final)
