"""Adapters and full weights on the wire and on disk, in the formats PEFT, vLLM and HF read.

Every weight transport carries an adapter as safetensors bytes with PEFT key names
(``base_model.model.<module path>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]).
``WeightsReady.digest`` is the digest of exactly those bytes (:mod:`services.weights.digest`), so
a receiver checks what it got before loading it. The filesystem transport writes a PEFT
directory (``adapter_config.json`` and ``adapter_model.safetensors``) that
``PeftModel.from_pretrained`` and vLLM load as it is.

Full weights (a trainer without LoRA) are the model's state dict with Hugging Face key names;
the filesystem transport writes them to :data:`FULL_WEIGHTS_FILE` in a directory of its own.
Either file is written from the tensors' memory piece by piece
(:class:`services.weights.stream.EncodedStream`), never assembled in one buffer.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FULL_WEIGHTS_FILE = "model.safetensors"
"""The file of full weights in a broadcast directory, named as Hugging Face names a model's."""


class AdapterFormatError(ValueError):
    """Bytes or a directory that do not hold a usable adapter; the message says what is wrong."""


def adapter_to_bytes(state_dict: Mapping[str, torch.Tensor]) -> bytes:
    """Safetensors bytes of an adapter state dict (tensors are moved to CPU first)."""
    if not state_dict:
        raise AdapterFormatError("refusing to serialise an adapter with no tensors")
    tensors = {key: t.detach().to("cpu").contiguous() for key, t in state_dict.items()}
    return bytes(st_save(tensors, metadata={"format": "pt"}))


def adapter_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """The state dict in safetensors bytes; AdapterFormatError when they are not an adapter."""
    try:
        state = st_load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterFormatError(
            f"{len(data)} bytes are not a safetensors adapter ({exc}); leading bytes "
            f"{bytes(data[:16])!r}"
        ) from exc
    if not state:
        raise AdapterFormatError("the safetensors data holds no tensors")
    return state


def peft_adapter_config(
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
    base_model_path: str = "",
    *,
    fan_in_fan_out: bool = False,
) -> dict[str, Any]:
    """An ``adapter_config.json`` that PEFT's ``PeftModel.from_pretrained`` and vLLM accept.

    ``fan_in_fan_out`` is True for an adapter over layers that store their weight [in, out]
    (GPT-2's Conv1D; :attr:`MultiLoRA.fan_in_fan_out <services.model.lora.MultiLoRA>`). The
    LoRA tensors are laid out the same either way; PEFT reads the flag to merge and to load
    without a warning.
    """
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_path or None,
        "r": int(rank),
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(set(target_modules)),
        "bias": "none",
        "fan_in_fan_out": bool(fan_in_fan_out),
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def write_peft_dir(
    path: Path | str,
    state_dict: Mapping[str, torch.Tensor],
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
    base_model_path: str = "",
    *,
    fan_in_fan_out: bool = False,
) -> Path:
    """Write a PEFT adapter directory at ``path`` atomically; returns the path.

    The files are written into a temporary sibling directory that is then renamed into place,
    so a reader polling ``path`` sees either nothing, the previous adapter or the complete new
    one, never half a file.
    """
    config = peft_adapter_config(
        rank, alpha, target_modules, base_model_path, fan_in_fan_out=fan_in_fan_out
    )

    def fill(staging: Path) -> None:
        (staging / ADAPTER_WEIGHTS).write_bytes(adapter_to_bytes(state_dict))
        (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    return _replace_dir(Path(path), fill)


def write_weights_dir(
    path: Path | str,
    pieces: Iterable[memoryview | bytes],
    adapter_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``pieces``, one after the other, into a directory at ``path``, atomically as
    :func:`write_peft_dir` writes; returns the path.

    ``pieces`` are a safetensors stream (:meth:`EncodedStream.segments
    <services.weights.stream.EncodedStream.segments>`: the header, then each tensor's own
    memory), so the file is written without a serialised copy. With ``adapter_config``
    (:func:`peft_adapter_config`) they are an adapter: :data:`ADAPTER_WEIGHTS` beside
    :data:`ADAPTER_CONFIG`, a PEFT directory; without, full weights: :data:`FULL_WEIGHTS_FILE`.
    """
    name = FULL_WEIGHTS_FILE if adapter_config is None else ADAPTER_WEIGHTS

    def fill(staging: Path) -> None:
        with (staging / name).open("wb", buffering=0) as file:
            for piece in pieces:
                view = memoryview(piece).cast("B")
                while len(view):  # a raw write may take less than it was given
                    view = view[file.write(view) :]
        if adapter_config is not None:
            text = json.dumps(adapter_config, indent=2, sort_keys=True) + "\n"
            (staging / ADAPTER_CONFIG).write_text(text)

    return _replace_dir(Path(path), fill)


def _replace_dir(target: Path, fill: Callable[[Path], None]) -> Path:
    """Make ``target`` a directory that ``fill`` wrote, replacing any earlier one at once.

    The files are written into a temporary sibling directory that is then renamed into place,
    so a reader polling ``target`` sees either nothing, the previous version or the complete new
    one, never half a file.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fill(staging)
        os.chmod(staging, 0o755)
        if target.exists():
            # rename() cannot replace a non-empty directory; move the old one aside first so
            # the window without weights is one rename long.
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, retired / target.name)
            os.replace(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def read_peft_dir(path: Path | str) -> tuple[dict[str, torch.Tensor], int, float, list[str]]:
    """``(state_dict, rank, alpha, target_modules)`` of a PEFT adapter directory."""
    source = Path(path)
    config_path, weights_path = source / ADAPTER_CONFIG, source / ADAPTER_WEIGHTS
    for required in (config_path, weights_path):
        if not required.is_file():
            raise AdapterFormatError(f"not a PEFT adapter directory: {required} is missing")
    try:
        config = json.loads(config_path.read_text())
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        target_modules = config["target_modules"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise AdapterFormatError(f"{config_path} is not a LoRA adapter config: {exc}") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterFormatError(f"{config_path}: peft_type {config['peft_type']!r} is not LORA")
    if isinstance(target_modules, str):
        # PEFT allows a regex string here; keep it as the single entry it is.
        target_modules = [target_modules]
    return adapter_from_bytes(weights_path.read_bytes()), rank, alpha, list(target_modules)
