"""Fixtures of the model tests: the tiny model, built once, and PEFT reference models."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from services.model.loader import load_model
from services.model.lora import DEFAULT_TARGET_MODULES, MultiLoRA
from services.model.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture
def multi_lora(tiny_dir: Path) -> Callable[..., tuple[Any, MultiLoRA]]:
    """A fresh tiny model with ``n_adapters`` slots of ``max_rank``."""

    def make(
        n_adapters: int = 4, max_rank: int = 8, dtype: torch.dtype = torch.float32
    ) -> tuple[Any, MultiLoRA]:
        model, _ = load_model(tiny_dir, dtype=dtype)
        return model, MultiLoRA.attach(model, n_adapters=n_adapters, max_rank=max_rank)

    return make


@pytest.fixture
def peft_reference(tiny_dir: Path) -> Callable[..., Any]:
    """A plain single-adapter PEFT model on a fresh base, holding the given LoRA weights."""

    def make(
        state_dict: Mapping[str, torch.Tensor],
        rank: int,
        alpha: float,
        target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
        dtype: torch.dtype = torch.float32,
    ) -> Any:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        base, _ = load_model(tiny_dir, dtype=dtype)
        config = LoraConfig(
            r=rank,
            # PEFT annotates an int but scales by lora_alpha / r in float; 7.5 works as it should.
            lora_alpha=alpha,  # type: ignore[arg-type]
            target_modules=list(target_modules),
            lora_dropout=0.0,
            init_lora_weights=False,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, config)
        result: Any = set_peft_model_state_dict(
            model, {k: v.to(dtype) for k, v in state_dict.items()}
        )
        assert not result.unexpected_keys
        assert not [k for k in result.missing_keys if "lora_" in k]
        return model

    return make


def randomize_slot(
    lora: MultiLoRA, idx: int, rank: int, alpha: float, seed: int, scale: float = 0.2
) -> None:
    """Reset ``idx`` at ``rank`` and give B random values (std ``scale``), so gradients w.r.t. A
    are non-zero and the adapter changes outputs."""
    lora.reset_slot(idx, rank, alpha, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in lora.layers.values():
            b = layer.lora_B[idx]
            b[:, :rank].copy_(scale * torch.randn(b.shape[0], rank, generator=generator))


@pytest.fixture(scope="session")
def randomize() -> Callable[..., None]:
    return randomize_slot
