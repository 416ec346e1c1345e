"""Per-run trainer state: the run's adapter slot, AdamW, learning-rate schedule and progress.

A run's state is made by the run mirror's creation hook and dropped by its deletion hook, on
every rank, so the state of every rank is the same function of the same lifecycle events. On
creation the slot is reset to a fresh PEFT adapter (A random from a seed derived from the run id
and its config seed, B = 0: policy version 0 is the base model) at the run's rank and alpha,
then, if the run has a complete checkpoint, the adapter, optimizer, scheduler and progress are
loaded from it. The checkpoint alone decides where a run resumes: ``progress.step`` is the
number of optimizer steps taken, which is also the step of the next RolloutBatch the run needs.

Each run's optimizer owns exactly its slot's parameters, and a slot takes part in a forward only
when a row of that run is in the batch, so stepping one run never moves another. On a sharded
trainer those are the rank's shards and the optimizer a
:class:`~services.trainer.sharding.ShardedAdamW`, whose state dict holds whole tensors on rank 0,
so checkpoints are the same whatever trainer wrote them.

A full-weight trainer (:class:`~services.model.full.FullWeights`) has one slot, the model's own
parameters: its run starts from the base model's weights, its optimizer owns every parameter,
and its checkpoints hold the whole model. It keeps no base model beside the trained one, so it
refuses a run with a KL penalty (``loss.kl_coef > 0``), whose reference is the base model.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from schemas.config import OrchConfig
from schemas.events import LoraSpec, WeightKind
from schemas.records import Progress
from schemas.tenant import DEFAULT_TENANT
from services.model.lora import MultiLoRA
from services.trainer.checkpoint import Checkpoint
from services.trainer.loss import LossParams
from services.trainer.schedule import build_lr_scheduler
from services.trainer.sharding import ShardedLoRA
from services.trainer.slots import WeightSlots

log = logging.getLogger(__name__)


class RunSetupError(ValueError):
    """A run that this trainer cannot serve; the message is the eviction reason."""


@dataclass
class RunState:
    """Everything the trainer keeps for one run."""

    idx: int
    run_id: str
    config: OrchConfig
    config_digest: str
    target_modules: tuple[str, ...]
    optimizer: torch.optim.AdamW
    scheduler: LambdaLR
    progress: Progress
    committed_step: int = 0
    """optimizer steps held by the latest checkpoint; steps from here on may be retrained"""
    resumed_from: int | None = None
    """checkpoint step this state was loaded from, None for a fresh run"""
    evicting: str | None = None
    """set once the trainer asked for this run's eviction: its batches are dropped from then on"""
    tenant: str = DEFAULT_TENANT
    """the tenant that owns the run (its subjects, its object store)"""
    fan_in_fan_out: bool = False
    """the adapter's layers store their weight [in, out] (GPT-2's Conv1D): PEFT must be told"""
    loss_params: LossParams = field(init=False)

    def __post_init__(self) -> None:
        self.loss_params = LossParams.from_config(self.config.loss)

    @property
    def next_step(self) -> int:
        """The step of the RolloutBatch this run trains on next."""
        return self.progress.step

    @property
    def temperature(self) -> float:
        # Temperature 0 is greedy sampling, whose distribution has no useful log-probabilities;
        # such a run is scored at temperature 1, as inference reports it.
        t = self.config.sampling.temperature
        return t if t > 0 else 1.0

    @property
    def lora_spec(self) -> LoraSpec:
        lora = self.config.model.lora
        return LoraSpec(
            rank=lora.rank,
            alpha=lora.alpha,
            target_modules=list(self.target_modules),
            fan_in_fan_out=self.fan_in_fan_out,
        )

    def checkpoint_due(self) -> bool:
        """After the step just taken: does the run's ckpt.interval (or its last step) ask for one?"""
        step = self.progress.step
        return step % self.config.ckpt.interval == 0 or step >= self.config.max_steps

    def advance(self, num_tokens: int, num_samples: int, reward_mean: float | None) -> None:
        """Count one optimizer step of this run and what it trained on."""
        self.progress.step += 1
        self.progress.total_tokens += num_tokens
        self.progress.total_samples += num_samples
        self.progress.reward_mean = reward_mean

    def to_checkpoint(self, lora: WeightSlots) -> Checkpoint:
        cfg = self.config.model.lora
        return Checkpoint(
            step=self.progress.step,
            kind=lora.kind,
            adapter=lora.slot_state_dict(self.idx),
            rank=cfg.rank,
            alpha=cfg.alpha,
            target_modules=list(self.target_modules),
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            progress={
                "step": self.progress.step,
                "total_tokens": self.progress.total_tokens,
                "total_samples": self.progress.total_samples,
                "reward_mean": self.progress.reward_mean,
            },
            meta={"config_digest": self.config_digest, "idx": self.idx},
            fan_in_fan_out=self.fan_in_fan_out,
        )


def slot_seed(run_id: str, config_seed: int) -> int:
    """The seed of a run's LoRA A initialisation: the same on every rank and every restart."""
    return zlib.crc32(f"{run_id}:{config_seed}".encode())


def create_run_state(
    lora: WeightSlots,
    idx: int,
    run_id: str,
    config: OrchConfig,
    config_digest: str,
    checkpoint: Checkpoint | None = None,
    *,
    tenant: str = DEFAULT_TENANT,
) -> RunState:
    """Reset slot ``idx`` for ``run_id`` and build its optimizer and schedule, resuming from
    ``checkpoint`` when given. Raises :class:`RunSetupError` when the run cannot be served."""
    cfg = config.model.lora
    kind = lora.kind
    if kind == "full" and config.loss.kl_coef > 0:
        raise RunSetupError(
            f"loss.kl_coef = {config.loss.kl_coef} asks for a KL penalty against the base model, "
            "and this trainer trains the model's full weights (--full-weights), keeping no base "
            "model to compare with; resubmit the run with loss.kl_coef = 0, or train it on a "
            "LoRA trainer"
        )
    if isinstance(lora, MultiLoRA) and cfg.rank > lora.max_rank:
        raise RunSetupError(
            f"LoRA rank {cfg.rank} exceeds this trainer's max_lora_rank {lora.max_rank}; "
            "resubmit the run with model.lora.rank <= that, or restart the trainer with a "
            "larger --max-lora-rank"
        )
    if checkpoint is not None and checkpoint.kind != kind:
        raise RunSetupError(_kind_mismatch(checkpoint, kind))
    if checkpoint is None or kind == "lora":
        # A full checkpoint overwrites every parameter, so putting the base weights back first
        # would read a whole model from disk for nothing.
        lora.reset_slot(idx, cfg.rank, cfg.alpha, seed=slot_seed(run_id, config.seed))
    optim = config.optim
    adamw: dict[str, Any] = {
        "lr": optim.lr,
        "betas": optim.betas,
        "eps": optim.eps,
        "weight_decay": optim.weight_decay,
    }
    optimizer = (
        lora.optimizer(idx, **adamw)
        if isinstance(lora, ShardedLoRA)
        else torch.optim.AdamW(lora.slot_parameters(idx), **adamw)
    )
    scheduler = build_lr_scheduler(optimizer, optim, config.max_steps)
    state = RunState(
        idx=idx,
        run_id=run_id,
        config=config,
        config_digest=config_digest,
        target_modules=lora.target_modules,
        optimizer=optimizer,
        scheduler=scheduler,
        progress=Progress(step=0, total_tokens=0, total_samples=0, tenant=tenant),
        tenant=tenant,
        fan_in_fan_out=isinstance(lora, MultiLoRA) and lora.fan_in_fan_out,
    )
    if checkpoint is not None:
        restore_checkpoint(lora, state, checkpoint)
    return state


def _kind_mismatch(ckpt: Checkpoint, kind: WeightKind) -> str:
    held = {"full": "the model's full weights", "lora": "a LoRA adapter"}
    trainer = {
        "full": "trains full weights (--full-weights)",
        "lora": "trains LoRA adapters (no --full-weights)",
    }
    return (
        f"checkpoint step_{ckpt.step} holds {held[ckpt.kind]} but this trainer {trainer[kind]}; "
        f"resume the run on a trainer that {trainer[ckpt.kind]}, or submit it under a new id"
    )


def restore_checkpoint(
    lora: WeightSlots, state: RunState, ckpt: Checkpoint, *, optimizer: bool = True
) -> None:
    """Load ``ckpt`` into ``state``'s slot; with ``optimizer``, also AdamW, the schedule and
    progress (the run resumes at the checkpoint's step). :class:`RunSetupError` if it does not
    fit the run."""
    cfg = state.config.model.lora
    if ckpt.kind != lora.kind:
        raise RunSetupError(_kind_mismatch(ckpt, lora.kind))
    if ckpt.kind == "lora" and ckpt.rank != cfg.rank:
        raise RunSetupError(
            f"checkpoint step_{ckpt.step} holds a rank-{ckpt.rank} adapter but the run's config "
            f"asks for rank {cfg.rank}; a run's LoRA shape cannot change: submit it under a new id"
        )
    lora.load_slot_state_dict(state.idx, ckpt.adapter, ckpt.rank, cfg.alpha)
    if not optimizer:
        return
    if _optimizer_state_fits(ckpt.optimizer, lora.slot_parameters(state.idx)):
        state.optimizer.load_state_dict(ckpt.optimizer)
    else:
        # The slots changed shape (a different --max-lora-rank): the adapter itself still fits,
        # only AdamW's moments must start again.
        log.warning(
            "trainer: %s: optimizer state of step_%d does not fit this trainer's slots; "
            "restarting AdamW's moments",
            state.run_id,
            ckpt.step,
        )
    state.scheduler.load_state_dict(ckpt.scheduler)
    state.progress = Progress(**ckpt.progress, tenant=state.tenant)
    state.committed_step = ckpt.step
    state.resumed_from = ckpt.step


def _optimizer_state_fits(saved: dict[str, object], params: Sequence[torch.Tensor]) -> bool:
    moments = saved.get("state")
    if not isinstance(moments, dict):
        return False
    for key, entry in moments.items():
        if not isinstance(key, int) or not 0 <= key < len(params) or not isinstance(entry, dict):
            return False
        avg = entry.get("exp_avg")
        if not isinstance(avg, torch.Tensor) or avg.shape != params[key].shape:
            return False
    return True
