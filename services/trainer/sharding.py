"""Sharded ranks: the base model's layers and their adapter slots split across ranks (FSDP2).

With ``sharding = "fsdp"`` each decoder block of the base model, with the LoRA slots of its
target layers, and then the rest of the model (embeddings, final norm, head) become FSDP2 units
(``torch.distributed.fsdp.fully_shard``) over all ranks: every parameter is split along its
first dimension, a rank holds ``1 / world_size`` of each, and a unit's parameters are
all-gathered just before its forward (and again for its backward), then freed. ``hybrid``
shards within a group of ``shard_ranks`` ranks (a node) and replicates across groups (HSDP: a
2-D mesh ``(replicate, shard)``, each gradient reduce-scattered within the group and then
all-reduced across groups).

Why the slots are sharded with their layers rather than replicated: a slot costs its parameters
plus AdamW's two moments plus its gradient, all float32, 16 bytes per parameter, against the
bfloat16 base's 2, so a replicated slot state per rank grows with the number of runs while the
base shrinks with the number of ranks. A Llama-70B with rank-16 adapters on every projection
holds 207M adapter parameters per run: 3.3 GB per run on every rank if replicated, against the
base's 17.5 GB per rank on 8 ranks, so four runs would hold more than the base. Sharded, the
slots cost ``1 / world_size`` of that, and every forward gathers every slot of a block (the
price: a block's gather grows with ``max_runs``); ``bench/sharding.py`` measures both.

What changes for the trainer, and what does not:

- gradients are reduce-scattered by FSDP into each rank's shard (summed, never averaged: see
  :mod:`services.trainer.distributed`), including zeros for a slot this rank's micro-batches did
  not use, so that every rank reduces the same tensors;
- each run's AdamW (:class:`ShardedAdamW`) steps its shards; after each step the run's adapter
  and moments are gathered whole to rank 0, which keeps them (host memory) for what only rank 0
  does: publish WeightsReady and write checkpoints. Checkpoints therefore hold whole tensors
  under PEFT names, the same files a ``dp`` trainer or a single process writes and reads;
- a slot is reset or loaded from whole tensors that every rank computes alike (the same seed,
  the same broadcast checkpoint), each rank keeping its shard: resuming re-shards.

Mixed precision on a GPU: parameters gathered and used in bfloat16, gradients reduced in
float32, and the slots (master weights and AdamW state) kept in float32 whatever ``dtype`` the
base model has. On the CPU (gloo) everything stays in the model's dtype.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from services.model.lora import MultiLoRA
from services.trainer.distributed import Ranks


def shard_model(
    model: nn.Module,
    lora: MultiLoRA,
    ranks: Ranks,
    *,
    device: torch.device,
    shard_ranks: int = 0,
    shard_slots: bool = True,
) -> MultiLoRA:
    """Apply FSDP2 to ``model`` (whose target layers ``lora`` already carries) over ``ranks``.

    Returns the slots to train: a :class:`ShardedLoRA`, or with ``shard_slots=False`` (what
    ``bench/sharding.py`` compares against) ``lora`` itself, its slots left whole on every rank
    and out of FSDP's hands (their gradients then go through :meth:`Ranks.sum_grads` as under
    ``dp``).
    """
    mesh = build_mesh(ranks, device.type, shard_ranks)
    if device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        with torch.no_grad():
            for layer in lora.layers.values():
                for p in [*layer.lora_A, *layer.lora_B]:
                    p.data = p.data.float()
    else:
        policy = MixedPrecisionPolicy()
    ignored = (
        None
        if shard_slots
        else {p for i in range(lora.n_adapters) for p in lora.slot_parameters(i)}
    )
    # Bottom-up: a block is sharded before anything that contains it.
    for block in reversed(decoder_blocks(model)):
        fully_shard(block, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum (see distributed.py), and a slot left out on one rank still takes part.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            module.set_reduce_scatter_unused_params(True, recurse=False)
    return ShardedLoRA(lora, ranks) if shard_slots else lora


def build_mesh(ranks: Ranks, device_type: str, shard_ranks: int = 0) -> DeviceMesh:
    """1-D over every rank for ``fsdp``; ``(replicate, shard)`` for ``hybrid``, ranks
    ``g * shard_ranks ..`` forming group ``g`` (torchrun numbers a node's ranks together)."""
    world = ranks.world_size
    if ranks.sharding != "hybrid":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    size = shard_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if size < 1 or world % size:
        raise ValueError(
            f"hybrid sharding needs shard groups that divide the {world} ranks; "
            f"shard_ranks = {size} does not (set shard_ranks to a divisor of the world size, or "
            "leave it 0 for the ranks of one node)"
        )
    return init_device_mesh(
        device_type, (world // size, size), mesh_dim_names=("replicate", "shard")
    )


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model, outermost first: the classes it names in
    ``_no_split_modules`` (what it says may not be cut across devices), else the longest
    ``nn.ModuleList``'s entries."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [list(m) for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len) if lists else []


def same_pass_grad_scale(lora: object) -> float:
    """What each rank's gradient is scaled by when every rank runs the same pass (the training
    commands): FSDP sums the ranks' gradients of sharded slots, so each sends its ``1 / N``;
    replicated slots keep their own gradient, which is already the pass's."""
    return 1.0 / lora.ranks.world_size if isinstance(lora, ShardedLoRA) else 1.0


class ShardedLoRA(MultiLoRA):
    """The multi-LoRA layers of a model sharded by :func:`shard_model`.

    ``slot_parameters`` are the sharded parameters (DTensors) each run's optimizer owns.
    ``slot_state_dict`` answers on rank 0 from the whole copy gathered after the slot last
    changed; every other operation runs on every rank in step with the others.
    """

    def __init__(self, lora: MultiLoRA, ranks: Ranks) -> None:
        super().__init__(lora.model, lora.layers, lora.context, lora.target_modules)
        self.ranks = ranks
        self._whole: dict[int, dict[str, Tensor]] = {}
        """rank 0: each slot's adapter under PEFT names, as :meth:`slot_state_dict` returns it"""

    # --- changed from whole tensors, on every rank ------------------------------------------

    def reset_slot(self, idx: int, rank: int, alpha: float, seed: int | None = None) -> None:
        if seed is None:
            raise ValueError("a sharded slot is reset from a seed, the same on every rank")
        with self._whole_slot(idx, gather=False):
            super().reset_slot(idx, rank, alpha, seed)

    def load_slot_state_dict(
        self, idx: int, state_dict: Mapping[str, Tensor], rank: int, alpha: float
    ) -> None:
        with self._whole_slot(idx, gather=False):
            super().load_slot_state_dict(idx, state_dict, rank, alpha)

    def gather_slot(self, idx: int) -> None:
        """Collective: refresh rank 0's whole copy of slot ``idx`` from the shards."""
        with self._whole_slot(idx, gather=True):
            pass

    # --- rank 0 -------------------------------------------------------------------------------

    def slot_state_dict(self, idx: int) -> dict[str, Tensor]:
        if not self.ranks.is_main:
            raise RuntimeError("only rank 0 keeps the sharded slots' whole adapters")
        return dict(self._whole[idx])

    # --- optimizers and reductions ------------------------------------------------------------

    def optimizer(self, idx: int, **adamw: Any) -> ShardedAdamW:
        return ShardedAdamW(self.slot_parameters(idx), lora=self, idx=idx, **adamw)

    # --- the whole view of one slot -----------------------------------------------------------

    @contextmanager
    def _whole_slot(self, idx: int, *, gather: bool) -> Iterator[None]:
        """Slot ``idx`` as whole plain parameters inside the block: gathered from the shards
        (a collective), or zeros for the block to fill. On a normal exit each rank keeps its
        shard of what the block wrote and rank 0 keeps the whole adapter; if the block raises,
        the shards are left as they were."""
        self.context.check_slot(idx)
        lists = [plist for layer in self.layers.values() for plist in (layer.lora_A, layer.lora_B)]
        sharded: list[DTensor] = [plist[idx] for plist in lists]
        if gather:
            wholes = gather_whole(sharded)
        else:
            wholes = [
                torch.zeros(p.shape, dtype=p.dtype, device=p.to_local().device) for p in sharded
            ]
        for plist, whole in zip(lists, wholes, strict=True):
            plist._parameters[str(idx)] = nn.Parameter(whole, requires_grad=False)
        try:
            yield
            if self.ranks.is_main:
                self._whole[idx] = super().slot_state_dict(idx)
            if not gather:
                with torch.no_grad():
                    for plist, shard in zip(lists, sharded, strict=True):
                        shard.to_local().copy_(local_shard(plist[idx].detach(), shard))
                        shard.grad = None
        finally:
            for plist, shard in zip(lists, sharded, strict=True):
                plist._parameters[str(idx)] = shard  # type: ignore[assignment]


class ShardedAdamW(torch.optim.AdamW):
    """AdamW over one run's sharded slot. Its moments are sharded like the parameters; after
    each step rank 0 keeps the whole state (what a checkpoint holds), and a whole state loaded
    into it (a checkpoint of any trainer) is sharded first."""

    def __init__(self, params: Any, *, lora: ShardedLoRA, idx: int, **adamw: Any) -> None:
        super().__init__(params, **adamw)
        self._lora = lora
        self._idx = idx
        self._whole_state: dict[int, dict[str, Any]] = {}

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = super().step(closure)
        self._lora.gather_slot(self._idx)
        self._gather_state()
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        saved = super().state_dict()
        saved["state"] = dict(self._whole_state)
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        params = self._params()
        sharded = {
            key: {
                name: local_value(value, params[key]) if _is_moment(value) else value
                for name, value in entry.items()
            }
            for key, entry in state_dict["state"].items()
        }
        super().load_state_dict({**state_dict, "state": sharded})
        if self._lora.ranks.is_main:
            self._whole_state = {
                key: {name: _host(value) for name, value in entry.items()}
                for key, entry in state_dict["state"].items()
            }

    def _params(self) -> list[DTensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _gather_state(self) -> None:
        params = self._params()
        keys = [
            (i, name)
            for i, p in enumerate(params)
            for name, value in self.state[p].items()
            if isinstance(value, DTensor)
        ]
        wholes = gather_whole([self.state[params[i]][name] for i, name in keys])
        if not self._lora.ranks.is_main:
            return
        state: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(params):
            if p in self.state:
                state[i] = {
                    n: _host(v) for n, v in self.state[p].items() if not isinstance(v, DTensor)
                }
        for (i, name), whole in zip(keys, wholes, strict=True):
            state[i][name] = whole.cpu()
        self._whole_state = state


def _is_moment(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0


def _host(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, Tensor) else value


# --- moving between whole tensors and shards ------------------------------------------------------


def local_shard(whole: Tensor, like: DTensor) -> Tensor:
    """This rank's shard of ``whole`` as ``like`` is sharded (no communication)."""
    whole = whole.to(device=like.to_local().device, dtype=like.dtype)
    return distribute_tensor(
        whole, like.device_mesh, like.placements, src_data_rank=None
    ).to_local()


def local_value(whole: Tensor, like: DTensor) -> DTensor:
    """``whole`` as a DTensor sharded like ``like`` (no communication)."""
    whole = whole.to(device=like.to_local().device)
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)


@torch.no_grad()
def gather_whole(tensors: list[DTensor]) -> list[Tensor]:
    """Each of ``tensors`` (sharded on dim 0 over one mesh, one dtype) whole on every rank, in
    one all-gather within the shard group: each shard padded to the longest, as FSDP pads."""
    if not tensors:
        return []
    first = tensors[0]
    mesh = first.device_mesh
    dim = next(i for i, p in enumerate(first.placements) if isinstance(p, Shard))
    group, size = mesh.get_group(dim), mesh.size(dim)
    rows = [math.ceil(t.shape[0] / size) for t in tensors]
    widths = [math.prod(t.shape[1:]) for t in tensors]
    padded = []
    for t, r, w in zip(tensors, rows, widths, strict=True):
        local = t.to_local().reshape(-1)
        padded.append(torch.nn.functional.pad(local, (0, r * w - local.numel())))
    flat = torch.cat(padded)
    out = flat.new_empty(size * flat.numel())
    dist.all_gather_single(out, flat, group=group)
    by_rank = out.view(size, -1)
    wholes, offset = [], 0
    for t, r, w in zip(tensors, rows, widths, strict=True):
        pieces = [
            by_rank[k, offset : offset + r * w].view(r, *t.shape[1:])[
                : max(0, min(r, t.shape[0] - k * r))
            ]
            for k in range(size)
        ]
        wholes.append(torch.cat(pieces))
        offset += r * w
    return wholes
