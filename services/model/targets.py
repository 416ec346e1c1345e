"""Which modules of a model carry LoRA, and which layer types the multi-LoRA layer can wrap.

A module is a target when its dotted name equals an entry of ``target_modules`` or ends with
``.`` + entry, as in PEFT. plexrl's LoRA wraps two layer types, both of the form y = x W' + b
with one weight matrix:

- ``nn.Linear``: weight [out, in], y = x W^T + b (Llama, Qwen, Mistral, Gemma, Phi-3, ...);
- ``transformers.pytorch_utils.Conv1D``: weight [in, out], y = x W + b (GPT-2's ``c_attn``,
  ``c_proj``, ``c_fc``). PEFT calls this layout ``fan_in_fan_out``.

A target that names anything else (a whole block, the fused expert weights of a mixture of
experts, an embedding) is an error that names the module and its type: silently training
fewer layers than asked for would be worse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

SUPPORTED_LAYERS = "nn.Linear and Conv1D (transformers.pytorch_utils.Conv1D)"


def is_target(name: str, target_modules: Sequence[str]) -> bool:
    """PEFT's rule: ``name`` equals an entry or ends with ``.`` + entry."""
    return any(name == t or name.endswith("." + t) for t in target_modules)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' Conv1D (weight [in, out]); False without transformers
    loaded, since then no model holds one."""
    import sys

    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and isinstance(module, utils.Conv1D)


def lora_dims(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a layer LoRA can wrap, None for any other module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        weight: Any = module.weight
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def find_targets(model: nn.Module, target_modules: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The ``(name, layer)`` of every target of ``model``, in ``named_modules`` order.

    Raises ValueError naming the first target that is not a layer LoRA can wrap (a module or a
    bare parameter such as a mixture of experts' fused ``gate_up_proj``), and when no layer
    matches at all.
    """
    targets = list(target_modules)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"target_modules must be a non-empty list of names, got {targets!r}")
    found = []
    for name, module in model.named_modules():
        if not name or not is_target(name, targets):
            continue
        if lora_dims(module) is None and not _is_wrapped(module):
            raise ValueError(
                f"{name} is a {type(module)}; plexrl's LoRA wraps {SUPPORTED_LAYERS}: "
                f"remove {_matching_entry(name, targets)!r} from target_modules"
            )
        found.append((name, module))
    for name, param in model.named_parameters():
        if is_target(name, targets):
            owner = model.get_submodule(name.rpartition(".")[0])
            raise ValueError(
                f"{name} is a parameter of shape {list(param.shape)} inside a "
                f"{type(owner)}, not a layer; plexrl's LoRA wraps {SUPPORTED_LAYERS}: "
                f"remove {_matching_entry(name, targets)!r} from target_modules"
            )
    if not found:
        names = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if lora_dims(m)})
        raise ValueError(
            f"no nn.Linear or Conv1D module of the model matches target_modules {targets}; "
            f"its layers that LoRA can wrap are named {names}"
        )
    return found


def _is_wrapped(module: nn.Module) -> bool:
    # A multi-LoRA layer already in place; attach() reports that case itself.
    return hasattr(module, "base_layer") and hasattr(module, "adapter_context")


def _matching_entry(name: str, targets: Sequence[str]) -> str:
    return next(t for t in targets if name == t or name.endswith("." + t))
