"""Loading a base model straight into its shards: no rank ever holds the whole of it.

``load_model`` reads every weight into host memory and then moves the model to the device,
which a base larger than one GPU (or, with eight ranks per node, larger than an eighth of the
host) cannot survive. On sharded ranks the trainer instead

1. builds the model on the meta device from ``config.json`` (shapes, no memory);
2. puts the adapter slots on it and shards it (:func:`~services.trainer.sharding.shard_model`),
   still without memory;
3. allocates each rank's shards on the device (``to_empty``), recomputes the buffers that no
   checkpoint holds (rotary frequencies) with the model's own initialisation, zeroes the slots;
4. reads from the model's safetensors files only the rows of each weight that this rank holds,
   one weight at a time.

Weights are found under their module names (a target layer's weight without the ``base_layer``
the adapter wrapping adds); a model whose files name them otherwise (transformers converts some
families' checkpoints while loading, e.g. fused experts) is refused with that name, and trains
with ``sharding = "dp"``.
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from services.model.loader import check_model_dir, load_tokenizer
from services.model.lora import MultiLoRA
from services.trainer.distributed import Ranks
from services.trainer.settings import TrainerSettings
from services.trainer.sharding import shard_model

SAFETENSORS_INDEX = "model.safetensors.index.json"


def load_sharded(
    settings: TrainerSettings,
    device: torch.device,
    ranks: Ranks,
    *,
    shard_slots: bool = True,
) -> tuple[Any, MultiLoRA, Any]:
    """``(model, slots, tokenizer)``: the base model of ``settings.model`` with ``max_runs``
    adapter slots, sharded across ``ranks`` and loaded shard by shard."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = check_model_dir(settings.model)
    dtype = torch.bfloat16 if settings.dtype == "bfloat16" else torch.float32
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)
    lora = MultiLoRA.attach(
        model,
        n_adapters=settings.max_runs,
        max_rank=settings.max_lora_rank,
        target_modules=settings.target_modules,
    )
    slots = shard_model(
        model,
        lora,
        ranks,
        device=device,
        shard_ranks=settings.shard_ranks,
        shard_slots=shard_slots,
    )
    model.to_empty(device=device)
    _initialise_buffers(model)
    _load_weights(model, lora, model_dir)
    model.eval()
    return model, slots, load_tokenizer(model_dir)


def _initialise_buffers(model: Any) -> None:
    """The buffers ``to_empty`` left uninitialised, computed as the model's own loading does."""
    for module in model.modules():
        if module._buffers:
            # (initialises the module's own weights too, which the checkpoint then overwrites)
            model._init_weights(module)


def _load_weights(model: nn.Module, lora: MultiLoRA, model_dir: Path) -> None:
    """Every base weight's local rows from the model's safetensors files; the slots zeroed."""
    files = _weight_files(model_dir)
    slot_ids = {id(p) for i in range(lora.n_adapters) for p in lora.slot_parameters(i)}
    with ExitStack() as stack, torch.no_grad():
        handles = {
            path: stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for path in set(files.values())
        }
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if id(param) in slot_ids:
                local.zero_()
                continue
            stored = name.replace(".base_layer.", ".")
            if stored not in files:
                raise KeyError(
                    f"{model_dir} holds no weight {stored!r} (the model's {name}): its files name "
                    "weights otherwise than its modules, which sharded loading does not convert; "
                    "train this model with sharding = 'dp'"
                )
            rows = handles[files[stored]].get_slice(stored)
            start, stop = _local_rows(param)
            local.copy_(rows[start:stop].reshape(local.shape))


def _local_rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows ``[start, stop)`` of ``param``'s first dimension this rank holds."""
    total = param.shape[0] if param.dim() else 1
    if not isinstance(param, DTensor):
        return 0, total
    mesh, placements = param.device_mesh, param.placements
    dims = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if not dims:
        return 0, total
    if len(dims) > 1 or placements[dims[0]] != Shard(0):
        raise NotImplementedError(f"sharded loading reads Shard(0) weights, not {placements}")
    size, me = mesh.size(dims[0]), mesh.get_local_rank(dims[0])
    rows = math.ceil(total / size)
    return min(total, me * rows), min(total, (me + 1) * rows)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Weight name -> the safetensors file that holds it."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(
            f"{model_dir} has neither {SAFETENSORS_INDEX} nor model.safetensors: sharded "
            "loading reads safetensors only; convert the weights, or use sharding = 'dp'"
        )
    with safe_open(str(single), framework="pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), single)
