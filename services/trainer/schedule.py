"""Per-run learning-rate schedule: linear warm-up from 0, then constant, linear or cosine decay.

With ``s`` the optimizer step (0-based), ``W`` the warm-up steps, ``S`` the run's max_steps and
``m`` the min_lr_ratio, the learning rate is ``lr * f(s)`` where::

    f(s) = s / W                                   for s < W
    p    = min(1, (s - W) / (S - W))               afterwards (p = 1 if S <= W)
    constant: f = 1
    linear:   f = 1 - (1 - m) * p
    cosine:   f = m + (1 - m) * (1 + cos(pi * p)) / 2

so the decaying schedules reach ``m`` at step ``S`` and stay there. Warm-up starts at exactly
0, as in the common ``get_*_schedule_with_warmup`` helpers: the first update moves no weights
but primes AdamW's moment estimates.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Literal

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:
    from schemas.config import OptimConfig

Schedule = Literal["constant", "linear", "cosine"]


def lr_multiplier(
    step: int,
    warmup_steps: int,
    max_steps: int,
    schedule: Schedule,
    min_lr_ratio: float,
) -> float:
    """``f(step)`` of the module docstring: the factor applied to the peak learning rate."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_steps < 0 or max_steps < 1:
        raise ValueError(
            f"need warmup_steps >= 0 and max_steps >= 1, got {warmup_steps}, {max_steps}"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown schedule {schedule!r}; use 'constant', 'linear' or 'cosine'")
    if step < warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    if max_steps <= warmup_steps:
        progress = 1.0
    else:
        progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: Optimizer, optim: OptimConfig, max_steps: int) -> LambdaLR:
    """A ``LambdaLR`` following :func:`lr_multiplier` for a run's optimizer.

    Call ``scheduler.step()`` after each ``optimizer.step()``. On resume, load the scheduler's
    state dict: it holds only the step counter, so the schedule itself always follows the
    run's current config.
    """
    fn = functools.partial(
        lr_multiplier,
        warmup_steps=optim.warmup_steps,
        max_steps=max_steps,
        schedule=optim.schedule,
        min_lr_ratio=optim.min_lr_ratio,
    )
    return LambdaLR(optimizer, lr_lambda=fn)
