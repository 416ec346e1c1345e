"""Load a Hugging Face causal LM and its tokenizer from a local directory.

The trainer and the torch inference engine load the same base model through this one function,
so both see the same dtype, the same eval-mode modules and the same tokenizer. Loading never
reaches the network: a model is a directory on disk, written by ``plexrl model tiny DIR`` or
downloaded beforehand.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ModelDirectoryError",
    "check_model_dir",
    "load_model",
    "load_tokenizer",
]


class ModelDirectoryError(FileNotFoundError):
    """The path is not a Hugging Face model directory; the message says how to get one."""


def check_model_dir(path: Path | str) -> Path:
    """``path`` as a Path if it holds a ``config.json``, else a ModelDirectoryError."""
    model_dir = Path(path)
    if not (model_dir / "config.json").is_file():
        raise ModelDirectoryError(
            f"not a Hugging Face model directory: {model_dir} has no config.json; "
            f"run `plexrl model tiny {model_dir}` to write the default tiny model there, "
            "or point --model at a directory holding a downloaded model"
        )
    return model_dir


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' progress bars: a one-shard model still draws one on stderr."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_tokenizer(path: Path | str) -> Any:
    """The tokenizer saved in a model directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(check_model_dir(path)), local_files_only=True)


def load_model(
    path: Path | str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the causal LM in ``path``, on ``device``, in eval mode.

    The model comes back in eval mode because the services only ever want deterministic
    forwards; training code switches modules to train mode itself where it needs dropout.
    """
    from transformers import AutoModelForCausalLM

    model_dir = check_model_dir(path)
    with quiet_progress_bars():
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, local_files_only=True
        )
    model.to(device)
    model.eval()
    return model, load_tokenizer(model_dir)
