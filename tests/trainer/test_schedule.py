"""The per-run learning-rate schedule on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from schemas.config import OptimConfig
from services.trainer.schedule import build_lr_scheduler, lr_multiplier


def test_warmup_is_linear_from_zero() -> None:
    got = [lr_multiplier(s, 4, 100, "constant", 0.0) for s in range(6)]
    assert got == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_constant_ignores_min_lr_ratio() -> None:
    assert [lr_multiplier(s, 0, 10, "constant", 0.3) for s in (0, 5, 10, 50)] == [1.0] * 4


def test_linear_decay_to_min_ratio() -> None:
    # Warm-up 2, max 12: decay over 10 steps from 1.0 to 0.1, i.e. 0.09 per step.
    got = [lr_multiplier(s, 2, 12, "linear", 0.1) for s in (0, 1, 2, 3, 7, 12, 20)]
    assert got == pytest.approx([0.0, 0.5, 1.0, 0.91, 0.55, 0.1, 0.1], abs=1e-12)


def test_cosine_decay_to_min_ratio() -> None:
    # Warm-up 0, max 8, min 0.2: f = 0.2 + 0.8 * (1 + cos(pi * s / 8)) / 2.
    got = [lr_multiplier(s, 0, 8, "cosine", 0.2) for s in (0, 2, 4, 6, 8, 9)]
    half_sqrt2 = math.sqrt(2) / 2
    want = [1.0, 0.2 + 0.4 * (1 + half_sqrt2), 0.6, 0.2 + 0.4 * (1 - half_sqrt2), 0.2, 0.2]
    assert got == pytest.approx(want, abs=1e-12)


def test_warmup_longer_than_the_run_still_ends_at_min_ratio() -> None:
    assert lr_multiplier(5, 10, 5, "linear", 0.0) == 0.5
    assert lr_multiplier(10, 10, 5, "linear", 0.25) == 0.25


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, 0, 10, "constant", 0.0), "step must be >= 0"),
        ((0, -1, 10, "constant", 0.0), "warmup_steps"),
        ((0, 0, 0, "constant", 0.0), "max_steps"),
        ((0, 0, 10, "constant", 1.5), "min_lr_ratio"),
        ((0, 0, 10, "exponential", 0.0), "unknown schedule 'exponential'"),
    ],
)
def test_invalid_arguments(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lr_multiplier(*args)


def test_lambda_lr_follows_the_config() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optim = OptimConfig(lr=0.5, warmup_steps=2, schedule="linear", min_lr_ratio=0.0)
    opt = torch.optim.AdamW([param], lr=optim.lr)
    sched = build_lr_scheduler(opt, optim, max_steps=6)
    seen = []
    for _ in range(7):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.0, 0.25, 0.5, 0.375, 0.25, 0.125, 0.0], abs=1e-12)


def test_scheduler_state_resumes_the_schedule() -> None:
    optim = OptimConfig(lr=1.0, warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=optim.lr)
    sched = build_lr_scheduler(opt, optim, max_steps=4)
    for _ in range(2):
        opt.step()
        sched.step()
    opt_state, sched_state = opt.state_dict(), sched.state_dict()

    opt2 = torch.optim.AdamW([param], lr=optim.lr)
    sched2 = build_lr_scheduler(opt2, optim, max_steps=4)
    opt2.load_state_dict(opt_state)
    sched2.load_state_dict(sched_state)
    seen = []
    for _ in range(3):
        seen.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert seen == pytest.approx([0.5, 0.25, 0.0], abs=1e-12)
