"""Data-parallel ranks of one trainer: who consumes, what is broadcast, what is all-reduced.

Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank holds the whole base model and every adapter
slot. Rank 0 alone consumes RolloutBatches, acks, publishes, checkpoints and writes progress; at
each trainer step it broadcasts the step's work (the batches) to the other ranks, every rank
packs the same micro-batches and takes every ``world_size``-th of them, and one all-reduce
(sum) per step joins each trained run's slot gradients.

Why a sum and not a mean: the loss of run ``k`` is normalised by ``N_k``, its loss tokens over
the *whole* step (every rank packs the whole step, so every rank knows ``N_k``). A rank's
gradient is then its share of ``dL_k/dθ``, and the shares add up to exactly the gradient a single
process would get. Dividing by the number of ranks would shrink every run's step.

With ``sharding`` ``fsdp`` or ``hybrid`` the base model and the slots are sharded instead
(:mod:`services.trainer.sharding`): the slots' gradients are then summed by FSDP's
reduce-scatter, and since every forward and backward gathers parameters from every rank, the
ranks make the same number of them (``lockstep``; see :mod:`services.trainer.step`).

Gloo on CPU, NCCL on GPU. A single process uses :data:`SINGLE`, whose operations do nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer's ranks and the collectives it takes part in."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    sharding: str = "dp"
    """'dp', 'fsdp' or 'hybrid' (TrainerSettings.sharding)"""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def lockstep(self) -> bool:
        """Whether every forward and backward is a collective (the model is sharded)."""
        return self.distributed and self.sharding != "dp"

    def broadcast_object(self, obj: Any) -> Any:
        """``obj`` from rank 0 on every rank (pickled; for work lists and checkpoints)."""
        if not self.distributed:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank if it is true on any rank (a stop request, say)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def sum_grads(self, params: Sequence[nn.Parameter], extras: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) the gradients of ``params`` in one flat buffer, and ``extras``.

        A parameter without a gradient on this rank (its run had no micro-batch here) takes part
        as zeros and comes back with the sum. ``extras`` (per-run loss sums and counts) travel in
        their own float64 buffer so that counts stay exact whatever the parameters' dtype.
        A sharded parameter (a DTensor) is left out: FSDP summed its gradient already.
        Returns the summed ``extras``.
        """
        if not self.distributed:
            return extras
        params = [p for p in params if not isinstance(p, DTensor)]
        if params:
            flat = torch.cat(
                [
                    p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
                    for p in params
                ]
            )
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
        summed = extras.to(torch.float64).clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed.to(extras.dtype)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        if not self.distributed:
            return t
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t


SINGLE = Ranks()


def init_ranks(device: str, sharding: str = "dp") -> Ranks:
    """Join the process group ``torchrun`` describes in the environment, or run alone.

    ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` are the
    standard torchrun variables; with ``WORLD_SIZE`` unset or 1 nothing is initialised.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return SINGLE
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    ):
        # torchrun's agent then keeps one store for every restart, so a restarted group can read
        # the addresses its predecessor published and wait for them forever
        # (pytorch/pytorch#135712); with the variable set each restart gets a store of its own.
        log.warning(
            "trainer: torchrun may restart these ranks but shares one rendezvous store across "
            "restarts, where a restarted group can hang in init_process_group; start torchrun "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
        )
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device == "cuda" else "gloo", rank=rank, world_size=world_size
        )
    return Ranks(rank=rank, world_size=world_size, local_rank=local_rank, sharding=sharding)


def close_ranks(ranks: Ranks) -> None:
    if ranks.distributed and dist.is_initialized():
        dist.destroy_process_group()
