"""Group-relative advantages (GRPO).

Each prompt is answered ``G`` times; the ``G`` rewards form a group, and each completion's
advantage is its reward measured against the group::

    A_i = r_i - mean(r)                          std_normalize = False (default)
    A_i = (r_i - mean(r)) / (std(r) + eps)       std_normalize = True

``std`` is the population standard deviation (divide by ``G``, not ``G - 1``), so a group of
one is defined (its advantage is 0). A group whose rewards are all equal carries no signal and
gets an advantage of exactly 0, not a rounding residue amplified by the division.

Mean-centring without the division is the default because dividing by the group std weights
prompts that are nearly solved or nearly hopeless (tiny std) as much as informative ones (Dr.
GRPO); the normalised form of the GRPO paper stays available.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def batch_advantages(
    rewards_PG: Tensor | Sequence[Sequence[float]], std_normalize: bool = False, eps: float = 1e-6
) -> Tensor:
    """Advantages of ``P`` prompts with ``G`` completions each, one group per row."""
    rewards_PG = _as_rewards(rewards_PG)
    if rewards_PG.dim() != 2 or rewards_PG.shape[1] == 0:
        raise ValueError(
            f"expected rewards of shape [P, G] with G >= 1, got {tuple(rewards_PG.shape)}"
        )
    if not torch.isfinite(rewards_PG).all():
        raise ValueError("rewards must be finite; an environment returned NaN or inf")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    centred_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if std_normalize:
        std_P1 = rewards_PG.std(dim=1, correction=0, keepdim=True)
        centred_PG = centred_PG / (std_P1 + eps)
    flat_P1 = rewards_PG.amax(dim=1, keepdim=True) == rewards_PG.amin(dim=1, keepdim=True)
    return torch.where(flat_P1, torch.zeros_like(centred_PG), centred_PG)


def _as_rewards(rewards: Tensor | Sequence[Sequence[float]]) -> Tensor:
    if isinstance(rewards, Tensor):
        return rewards if rewards.is_floating_point() else rewards.double()
    # Python floats are doubles; keep them so that hand-written rewards round-trip exactly.
    return torch.tensor(rewards, dtype=torch.float64)
