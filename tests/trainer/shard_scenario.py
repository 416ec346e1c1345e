"""The training the sharded-trainer test runs twice: on sharded ranks and in one process.

Three runs on three slots: ``run_a`` with a KL penalty (a base-model forward in each of its
micro-batches), ``run_b`` without, and ``run_c`` trained by commands (``forward_backward`` then
``optim_step``, every rank running the same pass). A step's micro-batches are cut small enough
that they do not split evenly over two ranks, and at step ``BAD_STEP`` run_b's batch carries an
advantage whose loss overflows, so that step must be refused for run_b alone, on every rank.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from trainer_support import make_batch, run_config, with_samples

from schemas.config import OrchConfig, orch_config_from_dict
from schemas.training import AdamParams, Datum, ForwardBackwardRequest, OptimStepRequest
from services.trainer.checkpoint import Checkpoint
from services.trainer.command_inbox import Command
from services.trainer.commands import CommandRunner
from services.trainer.distributed import SINGLE, Ranks
from services.trainer.slots import WeightSlots
from services.trainer.state import RunState, create_run_state
from services.trainer.step import StepExecutor

MAX_RUNS, MAX_RANK, BUDGET = 3, 4, 40
BAD_STEP = 3
RUNS = {"run_a": 0, "run_b": 1, "run_c": 2}
# eps well above the gradients' scale makes AdamW's update proportional to the gradient, so a
# gradient off by a factor (a mean over ranks instead of a sum) changes the result.
_COMMON = {"rank": 4, "alpha": 8.0, "lr": 1e-2, "eps": 1e-2, "interval": 1}


def run_cfg(run_id: str) -> OrchConfig:
    doc = run_config(**_COMMON, kl_coef=0.05 if run_id == "run_a" else 0.0)
    if run_id == "run_c":
        doc["driver"] = "commands"
    return orch_config_from_dict(doc)


class Scenario:
    """The runs' states on one model's slots, trained step by step as the trainer would."""

    def __init__(self, model: Any, lora: WeightSlots, ranks: Ranks = SINGLE) -> None:
        self.model, self.lora, self.ranks = model, lora, ranks
        self.executor = StepExecutor(
            model, lora, token_budget=BUDGET, pad_id=0, vocab_size=90, ranks=ranks
        )
        self.pool = ThreadPoolExecutor(1)
        self.commands = CommandRunner(
            model,
            lora,
            self.pool,
            token_budget=BUDGET,
            pad_id=0,
            vocab_size=90,
            device=torch.device("cpu"),
            output_dir=Path("unused"),
            ranks=ranks,
        )
        self.states: dict[int, RunState] = {}
        self.refused: list[tuple[str, int]] = []
        self.micro_batches: list[int] = []

    def add_runs(self, checkpoints: dict[str, Checkpoint | None]) -> None:
        for run_id, idx in RUNS.items():
            cfg = run_cfg(run_id)
            self.states[idx] = create_run_state(
                self.lora, idx, run_id, cfg, cfg.digest(), checkpoints.get(run_id)
            )

    def train(self, steps: range) -> None:
        for t in steps:
            work = []
            for run_id in ("run_a", "run_b"):
                idx = RUNS[run_id]
                batch = make_batch(run_id, self.states[idx].next_step, num_samples=5)
                if run_id == "run_b" and t == BAD_STEP:
                    batch = with_samples(batch, advantage=3e38)
                work.append((idx, batch))
            report = self.executor.run(work, self.states)
            for slot, result in report.runs.items():
                if result.trained:
                    self.states[slot].advance(
                        result.num_tokens, result.num_samples, result.reward_mean
                    )
                else:
                    self.refused.append((result.run_id, t))
            self._commands(t)

    def _commands(self, t: int) -> None:
        g = torch.Generator().manual_seed(t)
        data = []
        for i in range(3):
            tokens = torch.randint(4, 90, (5 + 2 * i,), generator=g).tolist()
            targets = [float(x) for x in [*tokens[1:], 7]]
            data.append(Datum(model_input=tokens, loss_fn_inputs={"target_tokens": targets}))
        fb = ForwardBackwardRequest(request_id=f"fb{t}", run_id="run_c", data=data)
        step = OptimStepRequest(
            request_id=f"os{t}", run_id="run_c", adam_params=AdamParams(learning_rate=1e-2)
        )
        commands = [
            Command("forward_backward", "default", fb),
            Command("optim_step", "default", step),
        ]
        results = asyncio.run(self.commands.execute(commands, self.states))
        assert all(r.error is None for r in results), results

    def checkpoints(self) -> dict[str, Checkpoint]:
        """Rank 0: every run's state as a checkpoint holds it."""
        return {s.run_id: s.to_checkpoint(self.lora) for s in self.states.values()}


def summary(checkpoints: dict[str, Checkpoint]) -> dict[str, Any]:
    """What the test compares: each run's adapter, AdamW moments and step."""
    return {
        run_id: {
            "adapter": {k: v.clone() for k, v in c.adapter.items()},
            "moments": {
                (i, name): v.clone()
                for i, entry in c.optimizer["state"].items()
                for name, v in entry.items()
                if name != "step"
            },
            "step": c.progress["step"],
        }
        for run_id, c in checkpoints.items()
    }
