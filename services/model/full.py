"""Full-weight training: the model's own parameters as the one "slot" a trainer trains.

A trainer started with ``--full-weights`` serves one run (``max_runs = 1``) and trains every
parameter of the model instead of a LoRA adapter. :class:`FullWeights` gives the trainer the
same per-slot operations :class:`~services.model.lora.MultiLoRA` does, over slot 0 alone:

- ``slot_parameters(0)``: every parameter of the model, a tied weight once;
- ``slot_state_dict(0)``: ``{name: parameter}`` under the names of ``model.named_parameters()``
  (Hugging Face names, a tied weight under its first name), the tensors themselves, not copies:
  the whole model is what is published and checkpointed, and a second copy of it would double
  the trainer's memory;
- ``reset_slot(0, ...)``: the base model's weights, read back from the model directory's
  safetensors files into the parameters one tensor at a time when a run trained them before
  (a fresh trainer's first run finds them there already);
- ``load_slot_state_dict(0, ...)``: a full checkpoint's tensors copied into the parameters.

There is no base model beside the trained one, so no forward can switch the "adapter" off:
``use`` refuses :data:`~services.model.routing.NO_ADAPTER`, and the trainer refuses a run that
asks for a KL penalty against the base model before it gets here.

:class:`TensorFiles` reads safetensors files lazily, so neither a base reload nor a checkpoint
restore ever holds more than one tensor beside the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from torch import nn

from services.model.lora import preview_keys
from services.model.peft_io import FULL_WEIGHTS_FILE
from services.model.routing import NO_ADAPTER

__all__ = ["FullWeights", "TensorFiles", "base_weight_files"]

SHARD_INDEX = "model.safetensors.index.json"


class TensorFiles(Mapping[str, torch.Tensor]):
    """The tensors of one or more safetensors files, each read from disk when asked for.

    Only the headers are read up front (names, shapes, dtypes); ``files[name]`` reads that one
    tensor into a new CPU tensor.
    """

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = [Path(p) for p in paths]
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for path in self.paths:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names: list[str] = f.keys()
                for name in names:
                    if name in self._where:
                        raise ValueError(
                            f"tensor {name!r} is in both {self._where[name]} and {path}"
                        )
                    self._where[name] = path
                    self._shapes[name] = tuple(f.get_slice(name).get_shape())

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._where[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def __reduce__(self) -> tuple[type[dict[str, torch.Tensor]], tuple[dict[str, torch.Tensor]]]:
        # Pickled (rank 0 broadcasting a checkpoint to ranks that may not share its disk), the
        # files travel as the tensors they hold, not as paths.
        return dict, (dict(self.items()),)


def base_weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face model directory: one file, or the shards its
    index names. A ValueError says what is missing."""
    model_dir = Path(model_dir)
    index = model_dir / SHARD_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / FULL_WEIGHTS_FILE
    if single.is_file():
        return [single]
    raise ValueError(
        f"full-weight training reloads the base model from its safetensors files, and "
        f"{model_dir} has neither {FULL_WEIGHTS_FILE} nor {SHARD_INDEX}; save the model with "
        "safe_serialization=True (save_pretrained's default) and point --model at it"
    )


class FullWeights:
    """The whole model as one trainable slot, with the slot operations the trainer uses."""

    kind: Literal["full"] = "full"
    """what the slot is published and checkpointed as (``WeightsReady.kind``)"""
    target_modules: tuple[str, ...] = ()
    """no module carries an adapter: every parameter is trained"""

    def __init__(self, model: nn.Module, base_files: Sequence[Path]) -> None:
        self.model = model
        self.base_files = list(base_files)
        self._params = dict(model.named_parameters())
        self._holds_base = True
        """the parameters are the base weights as loaded; False once a run had them"""

    @classmethod
    def attach(cls, model: nn.Module, model_dir: Path) -> FullWeights:
        """Make every parameter of ``model`` trainable; ``model_dir`` is where it was loaded
        from. Its files are checked against the parameters now, so a model whose base weights
        could not be put back fails at start-up rather than when its second run starts."""
        files = base_weight_files(model_dir)
        weights = cls(model, files)
        weights._check(TensorFiles(files), f"the base model in {model_dir}", exact=False)
        model.requires_grad_(True)
        return weights

    # --- choosing slots ------------------------------------------------------------------------

    @contextmanager
    def use(self, slot_ids: torch.Tensor | Sequence[int] | None) -> Iterator[None]:
        """Every row runs the trained model; a row asking for the base model cannot."""
        if slot_ids is not None and bool((torch.as_tensor(slot_ids) == NO_ADAPTER).any()):
            raise ValueError(
                "a full-weight trainer has no base model beside the trained one: no row can run "
                "with the adapter off (a KL penalty against the base model needs a LoRA trainer)"
            )
        yield

    # --- the one slot --------------------------------------------------------------------------

    def reset_slot(self, idx: int, rank: int, alpha: float, seed: int | None = None) -> None:
        """Give slot ``idx`` to a new run as the base model (a LoRA rank, alpha and seed mean
        nothing here)."""
        self._check_slot(idx)
        if not self._holds_base:
            self._copy_in(TensorFiles(self.base_files), "the base model", exact=False)
        # The run this is reset for trains these very tensors from here on.
        self._holds_base = False

    def slot_parameters(self, idx: int) -> list[nn.Parameter]:
        self._check_slot(idx)
        return list(self._params.values())

    def slot_state_dict(self, idx: int) -> dict[str, torch.Tensor]:
        """Every parameter under its Hugging Face name, detached but not copied."""
        self._check_slot(idx)
        return {name: p.detach() for name, p in self._params.items()}

    def load_slot_state_dict(
        self, idx: int, state_dict: Mapping[str, torch.Tensor], rank: int, alpha: float
    ) -> None:
        """Copy a full state dict (names as :meth:`slot_state_dict` gives them) into the
        parameters; every name and shape is checked before the first byte is written."""
        self._check_slot(idx)
        self._copy_in(state_dict, "the checkpoint", exact=True)

    # --- internals -----------------------------------------------------------------------------

    def _check_slot(self, idx: int) -> None:
        if idx != 0:
            raise IndexError(f"a full-weight trainer has one slot (0), not slot {idx}")

    def _check(self, source: Mapping[str, torch.Tensor], what: str, *, exact: bool) -> None:
        """Raise a ValueError unless ``source`` holds every parameter at its shape (and, when
        ``exact``, nothing else: a checkpoint of another model must not half-load)."""
        missing = sorted(set(self._params) - set(source))
        unexpected = sorted(set(source) - set(self._params)) if exact else []
        if missing or unexpected:
            raise ValueError(
                f"{what} does not fit this model: missing {preview_keys(missing)}, unexpected "
                f"{preview_keys(unexpected)}"
            )
        for name, param in self._params.items():
            shape = source.shape(name) if isinstance(source, TensorFiles) else source[name].shape
            if tuple(shape) != tuple(param.shape):
                raise ValueError(
                    f"{what}: {name} has shape {list(shape)}, the model's parameter "
                    f"{list(param.shape)}"
                )

    @torch.no_grad()
    def _copy_in(self, source: Mapping[str, torch.Tensor], what: str, *, exact: bool) -> None:
        self._check(source, what, exact=exact)
        # From the first copy on, the parameters are neither the base nor what they were.
        self._holds_base = False
        for name, param in self._params.items():
            param.copy_(source[name])
            param.grad = None
