"""The model families plexrl trains, their default LoRA targets, and the admission check.

A family is a Hugging Face ``model_type``. Each supported one has a tiny random model built from
its own transformers config in-process (:func:`tiny_family_model`, no download), on which the
tests check the multi-LoRA layer against PEFT, the published adapter's module names and the
sampler against the trainer's forward.

Default targets. Like PEFT, plexrl picks the LoRA targets from ``config.model_type`` when a
deployment names none. Departure from PEFT: PEFT's table
(``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``) targets only
``q_proj`` and ``v_proj`` of a Llama; plexrl targets every attention and MLP projection, as it
always has for its tiny Llama (``DEFAULT_TARGET_MODULES``), with the family's own names (Phi-3's
fused ``qkv_proj`` / ``gate_up_proj``, GPT-2's ``c_attn`` / ``c_proj`` / ``c_fc``). Mixtures of
experts get attention only: their experts are fused 3-D parameters, not layers, and stay frozen.
A ``model_type`` plexrl does not list falls back to PEFT's table.

:func:`check_targets` is the registry's admission check: it builds the model from its config on
the meta device (no weights, no memory) and raises ValueError naming any target that is not a
layer plexrl's LoRA can wrap.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.config import DEFAULT_TARGET_MODULES
from services.model.targets import find_targets

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

DEFAULT_TARGETS_BY_MODEL_TYPE: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"),
        DEFAULT_TARGET_MODULES,
    ),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    **dict.fromkeys(("qwen2_moe", "qwen3_moe", "olmoe", "mixtral"), ATTENTION_TARGETS),
}
"""plexrl's LoRA targets per ``model_type``; others fall back to PEFT's table."""


@dataclass(frozen=True)
class Family:
    """One model family plexrl is tested on."""

    name: str
    model_type: str
    notes: str
    config: Mapping[str, Any]
    """config fields of the family besides the shape (:class:`FamilyShape`)"""


@dataclass(frozen=True, kw_only=True)
class FamilyShape:
    """The shape every family's test model shares; the defaults are the tiny test models'."""

    vocab_size: int = 96
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128


_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "llama", "the default tiny model's architecture", {}),
        Family("qwen2", "qwen2", "biases on q/k/v", {}),
        Family("qwen3", "qwen3", "q/k RMS norms", {}),
        Family("mistral", "mistral", "sliding-window attention", {"sliding_window": 8}),
        Family(
            "gemma3",
            "gemma3_text",
            "Gemma 3 text model: sliding and full layers, scaled embeddings",
            {"sliding_window": 8},
        ),
        Family("phi3", "phi3", "fused qkv_proj and gate_up_proj", {}),
        Family(
            "gpt2",
            "gpt2",
            "Conv1D layers (weight [in, out]); adapter_config says fan_in_fan_out",
            {},
        ),
        Family(
            "qwen3_moe",
            "qwen3_moe",
            "mixture of experts: LoRA on attention, fused expert weights frozen",
            {"num_experts": 4, "num_experts_per_tok": 2},
        ),
    )
}
"""The families with a tiny test model, by plexrl's name for them."""


def default_target_modules(model_type: str) -> tuple[str, ...]:
    """The LoRA targets of a ``model_type`` when a deployment names none (see the module doc)."""
    if model_type in DEFAULT_TARGETS_BY_MODEL_TYPE:
        return DEFAULT_TARGETS_BY_MODEL_TYPE[model_type]
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT

    if model_type in PEFT:
        return tuple(PEFT[model_type])
    raise ValueError(
        f"plexrl has no default LoRA target_modules for model_type {model_type!r}; set "
        "target_modules to the names of the model's nn.Linear or Conv1D layers"
    )


def tiny_family_config(family: str, shape: FamilyShape | None = None) -> Any:
    """The transformers config of ``family``'s test model (the tiny one unless ``shape``)."""
    from transformers import AutoConfig

    spec, shape = _family(family), shape or FamilyShape()
    fields: dict[str, Any] = {**vars(shape), **_TOKEN_IDS, **spec.config}
    fields["head_dim"] = shape.hidden_size // shape.num_attention_heads
    if "num_experts" in spec.config:
        # Each token's top-k experts together are as wide as a dense model's MLP.
        fields["moe_intermediate_size"] = (
            shape.intermediate_size // spec.config["num_experts_per_tok"]
        )
    if spec.model_type == "gemma3_text":
        # Sliding and full attention layers alternate, so a model of two layers has both.
        fields["layer_types"] = [
            "full_attention" if i % 2 else "sliding_attention"
            for i in range(shape.num_hidden_layers)
        ]
    if spec.model_type == "gpt2":
        # GPT-2 names its shape in its own words and has no key-value heads.
        fields = {
            "vocab_size": shape.vocab_size,
            "n_embd": shape.hidden_size,
            "n_inner": shape.intermediate_size,
            "n_layer": shape.num_hidden_layers,
            "n_head": shape.num_attention_heads,
            "n_positions": shape.max_position_embeddings,
            **_TOKEN_IDS,
        }
    return AutoConfig.for_model(spec.model_type, **fields)


def tiny_family_model(family: str, seed: int = 0, shape: FamilyShape | None = None) -> Any:
    """A tiny random causal LM of ``family`` in float32, eval mode, built without a download.

    The same seed gives the same weights, and building leaves the caller's RNG as it was.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_family_config(family, shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def _family(family: str) -> Family:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[family]


# --- admission ---------------------------------------------------------------------------------


def check_targets(
    model_config: Mapping[str, Any] | Path | str | Any,
    target_modules: Sequence[str] | None = None,
) -> list[str]:
    """The module paths LoRA would wrap; ValueError when a target is not a wrappable layer.

    ``model_config`` is a model directory (its ``config.json``), a ``config.json`` dict or a
    transformers config. ``target_modules`` None checks the family's defaults. The model is
    built on the meta device, so checking a 70B config costs no memory and well under a second.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = _load_config(model_config)
    targets = (
        default_target_modules(config.model_type) if target_modules is None else target_modules
    )
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(
            f"cannot build a causal LM of model_type {config.model_type!r} from its config: {exc}"
        ) from exc
    return [name for name, _ in find_targets(model, targets)]


def _load_config(model_config: Mapping[str, Any] | Path | str | Any) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_config, PretrainedConfig):
        return model_config
    if isinstance(model_config, Path | str):
        path = Path(model_config)
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise ValueError(f"no model config at {path}: expected a directory with config.json")
        try:
            model_config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{config_file} is not JSON: {exc}") from exc
    if not isinstance(model_config, Mapping):
        raise ValueError(
            f"a model config is a directory, a config.json dict or a transformers config, "
            f"got {type(model_config).__name__}"
        )
    fields = dict(model_config)
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str) or not model_type:
        raise ValueError("the model config has no model_type; is it a transformers config.json?")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"transformers cannot read this {model_type!r} config: {exc}") from exc
