"""Fixtures of the weight-transport tests: a small PEFT-keyed adapter and its LoRA spec."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from schemas.events import LoraSpec

RANK = 4
MODULES = {
    # module path: (in_features, out_features)
    "model.layers.0.self_attn.q_proj": (64, 64),
    "model.layers.0.mlp.down_proj": (192, 64),
    "model.layers.1.mlp.up_proj": (64, 192),
}


def _make_adapter(
    seed: int, rank: int = RANK, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """PEFT keys, A [rank, in] and B [out, rank], random values (B non-zero on purpose)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, (fan_in, fan_out) in MODULES.items():
        prefix = f"base_model.model.{name}"
        state[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator).to(dtype)
        state[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator).to(dtype)
    return state


@pytest.fixture
def make_adapter() -> Callable[..., dict[str, torch.Tensor]]:
    """``make_adapter(seed, rank=4, dtype=float32)``: a fresh adapter per seed."""
    return _make_adapter


@pytest.fixture
def adapter() -> dict[str, torch.Tensor]:
    return _make_adapter(seed=0)


@pytest.fixture
def lora() -> LoraSpec:
    return LoraSpec(rank=RANK, alpha=8.0, target_modules=["q_proj", "down_proj", "up_proj"])


@pytest.fixture
def run_id(uid: str) -> str:
    return f"run_w{uid}"
