"""Helpers of the inference tests: announce runs as the registry does, make random adapters."""

from __future__ import annotations

import torch

from schemas.events import LoraSpec, RunDiscovered, RunEvicted
from schemas.subjects import DISCOVERED, EVICTED
from services.bus import Bus
from services.model.lora import DEFAULT_TARGET_MODULES, MultiLoRA

LORA_TARGETS = list(DEFAULT_TARGET_MODULES)


async def discover(bus: Bus, run_id: str, idx: int, rank: int = 4, alpha: float = 8.0) -> None:
    """Publish the RunDiscovered the registry would (the contract the run mirror consumes)."""
    config = {"model": {"lora": {"rank": rank, "alpha": alpha}}}
    await bus.publish(DISCOVERED, RunDiscovered(run_id=run_id, idx=idx, config=config))


async def evict(bus: Bus, run_id: str, idx: int) -> None:
    await bus.publish(EVICTED, RunEvicted(run_id=run_id, idx=idx, reason="test"))


def lora_spec(rank: int = 4, alpha: float = 8.0) -> LoraSpec:
    return LoraSpec(rank=rank, alpha=alpha, target_modules=LORA_TARGETS)


def randomize_slot(lora: MultiLoRA, idx: int, rank: int, alpha: float, seed: int) -> None:
    """Reset slot ``idx`` at ``rank`` and give B random values, so the adapter changes outputs."""
    lora.reset_slot(idx, rank, alpha, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in lora.layers.values():
            b = layer.lora_B[idx]
            b[:, :rank].copy_(0.3 * torch.randn(b.shape[0], rank, generator=generator))


def random_adapter(
    lora: MultiLoRA, idx: int, rank: int, alpha: float, seed: int
) -> dict[str, torch.Tensor]:
    """A PEFT-keyed random adapter, left in slot ``idx`` of ``lora`` for reference runs."""
    randomize_slot(lora, idx, rank, alpha, seed)
    return lora.slot_state_dict(idx)
