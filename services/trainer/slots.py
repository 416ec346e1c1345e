"""What the trainer trains: per-run slots of weights on one model.

Two kinds satisfy :class:`WeightSlots`: :class:`~services.model.lora.MultiLoRA`, one LoRA adapter
slot per run (the default), and :class:`~services.model.full.FullWeights`, the model's own
parameters as the single slot of a ``--full-weights`` trainer. Run states, the step and the
committer are written against this interface; where the two differ (a KL reference, the LoRA
rank bound, the checkpoint and announcement format) they ask its ``kind``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from schemas.events import WeightKind


class WeightSlots(Protocol):
    """The per-slot operations of a run's weights."""

    @property
    def kind(self) -> WeightKind:
        """``'lora'`` for adapter slots, ``'full'`` for the model's own parameters."""
        ...

    @property
    def target_modules(self) -> tuple[str, ...]: ...

    def use(self, slot_ids: torch.Tensor | Sequence[int] | None) -> AbstractContextManager[None]:
        """Route the forwards inside the block: one slot per row, -1 for the base model."""
        ...

    def reset_slot(self, idx: int, rank: int, alpha: float, seed: int | None = None) -> None:
        """Give slot ``idx`` to a new run: it then computes what the base model does."""
        ...

    def slot_parameters(self, idx: int) -> list[nn.Parameter]:
        """What the run's optimizer owns."""
        ...

    def slot_state_dict(self, idx: int) -> dict[str, torch.Tensor]:
        """What is checkpointed and published, under the names its consumers load."""
        ...

    def load_slot_state_dict(
        self, idx: int, state_dict: Mapping[str, torch.Tensor], rank: int, alpha: float
    ) -> None:
        """The inverse of :meth:`slot_state_dict`."""
        ...
