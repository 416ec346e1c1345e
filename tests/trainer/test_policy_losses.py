"""Each loss.mode against a hand-computed example: the token losses, their gradients with
respect to the trained log-probabilities, and the tokens the trust region acted on.

The example: two rows of the same three tokens, ``logp = [-1, -2, -0.5]`` under the trained
policy and ``q = [-1.2, -1, -0.5]`` under the sampling one, so ``r = [e^0.2, e^-1, 1] =
[1.2214, 0.3679, 1]``; row 0 has ``A = +1``, row 1 ``A = -2``; ``clip_low = clip_high = 0.2``.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.loss import LossParams, token_loss
from services.trainer.step import _denominators

LOGP = [-1.0, -2.0, -0.5]
OLD = [-1.2, -1.0, -0.5]
R = [math.exp(0.2), math.exp(-1.0), 1.0]


def _run(mode: str, **params):
    logp = torch.tensor([LOGP, LOGP], requires_grad=True)
    old = torch.tensor([OLD, OLD])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, stats = token_loss(logp, old, adv, mask, LossParams(mode=mode, **params))
    loss.sum().backward()
    return loss.detach().tolist(), logp.grad.tolist(), stats.clipped_BT.tolist()


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    loss, grad, clipped = _run("cispo")
    w = [1.2, 0.8, 1.0]  # clip(r, 0.8, 1.2)
    assert loss[0] == pytest.approx([-x for x in w]) and loss[1] == pytest.approx(
        [2 * x for x in w]
    )
    # -sg(w) A grad logp: no token loses its gradient, unlike PPO's clip
    assert grad[0] == pytest.approx([-x for x in w]) and grad[1] == pytest.approx(
        [2 * x for x in w]
    )
    assert clipped == [[True, True, False]] * 2


def test_tis_truncates_the_weight_from_above_only():
    loss, grad, clipped = _run("tis", tis_cap=1.1)
    w = [1.1, R[1], 1.0]
    assert loss[0] == pytest.approx([-x for x in w], abs=1e-6)
    assert grad[0] == pytest.approx([-x for x in w], abs=1e-6)
    assert grad[1] == pytest.approx([2 * x for x in w], abs=1e-6)
    assert clipped == [[True, False, False]] * 2


def test_gspo_clips_one_ratio_per_sequence():
    loss, grad, clipped = _run("gspo")
    s = math.exp((0.2 - 1.0 + 0.0) / 3)  # 0.7659: the geometric mean of the token ratios
    # row 0, A = +1: min(s, clip(s)) = s (s < 0.8 is not clipped for A > 0)
    assert loss[0] == pytest.approx([-s / 3] * 3)
    assert grad[0] == pytest.approx([-s / 3] * 3)  # d(-s)/d logp_t = -s / n
    # row 1, A = -2: min(-2s, -2 * 0.8) = -1.6, the clipped branch: no gradient
    assert loss[1] == pytest.approx([1.6 / 3] * 3)
    assert grad[1] == pytest.approx([0.0] * 3)
    assert clipped == [[False] * 3, [True] * 3]


def test_dppo_bounds_the_probability_change_not_the_ratio():
    loss, grad, clipped = _run("dppo", tv_delta=0.2)
    p = [math.exp(x) for x in LOGP]  # 0.368, 0.135, 0.607
    p_old = [math.exp(x) for x in OLD]  # 0.301, 0.368, 0.607
    assert p[0] - p_old[0] < 0.2 and p_old[1] - p[1] > 0.2
    # row 0 (A > 0) keeps token 1, which the ratio mask (r = 0.37 < 0.8) would drop
    assert loss[0] == pytest.approx([-x for x in R])
    assert grad[0] == pytest.approx([-x for x in R])
    # row 1 (A < 0) drops token 1: it lost more than 0.2 of probability
    assert loss[1] == pytest.approx([2 * R[0], 0.0, 2.0])
    assert grad[1] == pytest.approx([2 * R[0], 0.0, 2.0])
    assert clipped == [[False, False, False], [False, True, False]]
    _, _, masked = _run("mask")
    assert masked[0] == [True, True, False]


def test_the_modes_agree_at_ratio_one():
    """On-policy (r = 1 everywhere) every mode's gradient is -A grad logp, token by token
    (gspo's spread evenly over the sequence's tokens)."""
    logp = torch.tensor([LOGP], requires_grad=True)
    for mode in ("clip", "mask", "cispo", "gspo", "dppo", "tis"):
        logp.grad = None
        loss, _ = token_loss(
            logp, logp.detach(), torch.tensor([0.5]), torch.ones(1, 3), LossParams(mode=mode)
        )
        loss.sum().backward()
        expected = [-0.5 / 3] * 3 if mode == "gspo" else [-0.5] * 3
        assert logp.grad.tolist()[0] == pytest.approx(expected), mode


def test_dr_grpo_divides_by_a_constant_not_by_the_tokens(tmp_path):
    from schemas.config import orch_config_from_dict
    from services.trainer.state import RunState

    def state(normalize: str) -> RunState:
        config = orch_config_from_dict(
            {"loss": {"normalize": normalize}, "sampling": {"max_tokens": 20}}
        )
        s = RunState.__new__(RunState)
        s.config = config
        return s

    class Batch:
        samples = [object()] * 4

    denominators = _denominators(
        {0: 37, 1: 37}, {0: Batch(), 1: Batch()}, {0: state("tokens"), 1: state("constant")}
    )
    assert denominators == {0: 37, 1: 4 * 20}


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown loss mode 'ppo2'; use one of clip, mask, cispo"):
        _run("ppo2")
