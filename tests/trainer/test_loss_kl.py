"""The KL term: what the gradient of each estimator is in expectation, and k1 as a reward.

The expectation tests sum exactly over a three-token vocabulary, so they compare gradients
without sampling noise: E_{x~q}[grad loss(x)] = sum_x q(x) * grad loss(x), with q held fixed
(the sampling distribution is data, not something the loss differentiates).
"""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.loss import LossParams, token_loss

THETA = [0.3, -0.2, 0.5]
"""Logits of pi, the trained policy, over a three-token vocabulary."""
REF = [0.0, 0.4, -0.6]
"""Logits of the reference (the base model)."""


def _expected_gradient(estimator: str, sampler_shift: list[float] | None = None) -> torch.Tensor:
    """E_{x~mu}[grad_theta loss(x)] for a token drawn from mu, with A = 0 (the KL alone).

    mu is pi itself (on-policy), or pi with its logits shifted by ``sampler_shift`` (a lagging
    sampler); the token's sampling log-probability is log mu(x), as a RolloutBatch carries it.
    """
    theta = torch.tensor(THETA, dtype=torch.float64, requires_grad=True)
    logp_V = torch.log_softmax(theta, -1)
    ref_V = torch.log_softmax(torch.tensor(REF, dtype=torch.float64), -1)
    shift = torch.tensor(sampler_shift or [0.0, 0.0, 0.0], dtype=torch.float64)
    mu_V = torch.log_softmax(theta.detach() + shift, -1)
    params = LossParams(kl_coef=1.0, kl_estimator=estimator)  # type: ignore[arg-type]
    # One row per vocabulary entry: row x is "the sampled token was x".
    loss_BT, _ = token_loss(
        logp_V.view(3, 1),
        mu_V.view(3, 1),
        torch.zeros(3, dtype=torch.float64),
        torch.ones(3, 1, dtype=torch.bool),
        params,
        ref_V.view(3, 1),
    )
    (mu_V.exp() * loss_BT[:, 0]).sum().backward()
    assert theta.grad is not None
    return theta.grad


def _kl_gradient(reverse_direction: bool) -> torch.Tensor:
    """grad_theta KL(pi || ref), or of KL(ref || pi) when ``reverse_direction``, in closed form."""
    theta = torch.tensor(THETA, dtype=torch.float64, requires_grad=True)
    logp_V = torch.log_softmax(theta, -1)
    ref_V = torch.log_softmax(torch.tensor(REF, dtype=torch.float64), -1)
    if reverse_direction:
        kl = (ref_V.exp() * (ref_V - logp_V)).sum()
    else:
        kl = (logp_V.exp() * (logp_V - ref_V)).sum()
    kl.backward()
    assert theta.grad is not None
    return theta.grad


def test_k1_as_a_reward_has_the_gradient_of_kl_pi_ref_on_policy() -> None:
    got = _expected_gradient("k1")
    want = _kl_gradient(reverse_direction=False)
    assert want.abs().max() > 0.05  # pi and ref differ: there is a gradient to get right
    assert torch.allclose(got, want, atol=1e-12)


def test_k1_as_a_reward_stays_right_on_samples_of_a_lagging_policy() -> None:
    # mu's logits are shifted by up to 0.1, so the ratios pi / mu are 1.002, 1.107 and 0.953,
    # all inside the clip: the importance ratio alone corrects the sampling distribution.
    got = _expected_gradient("k1", sampler_shift=[0.05, -0.05, 0.1])
    assert torch.allclose(got, _kl_gradient(reverse_direction=False), atol=1e-12)


def test_k3_as_a_loss_has_the_gradient_of_kl_ref_pi_on_policy() -> None:
    # E_pi[(1 - ref / pi) grad log pi] = -sum_x ref(x) grad log pi(x) = grad KL(ref || pi).
    got = _expected_gradient("k3")
    assert torch.allclose(got, _kl_gradient(reverse_direction=True), atol=1e-12)
    # ... which is not the gradient of KL(pi || ref), though it points the same way here.
    other = _kl_gradient(reverse_direction=False)
    assert (got - other).abs().max() > 0.01
    assert float(torch.dot(got, other)) > 0


@pytest.mark.parametrize(
    ("logp", "ref", "loss", "grad", "clipped"),
    [
        # logp = log 0.75, old = log 0.5 (r = 1.5), ref = log 0.25: k1 = log 3, A = 0, so the
        # token's advantage is -0.1 * log 3 < 0. PPO's min(1.5 * A_t, 1.2 * A_t) = 1.5 * A_t:
        # loss 0.15 * log 3, gradient -A_t * r = 0.15 * log 3. The penalty is importance
        # weighted, as the reward is.
        (0.75, 0.25, 0.15 * math.log(3.0), 0.15 * math.log(3.0), False),
        # logp = log 0.25 (r = 0.5), ref = log 0.125: k1 = log 2, A_t = -0.1 * log 2. r is below
        # 1 - 0.2 with A_t < 0: PPO's clipped branch 0.8 * A_t wins, loss 0.08 * log 2, no
        # gradient. The penalty is clipped with the reward.
        (0.25, 0.125, 0.08 * math.log(2.0), 0.0, True),
        # logp = log 0.75, ref = log 0.9: k1 = log(0.75 / 0.9) < 0 is a bonus, A_t > 0 and
        # r = 1.5 > 1.2: clipped at loss -1.2 * A_t = 0.12 * log(0.75 / 0.9), no gradient.
        (0.75, 0.9, 0.12 * math.log(0.75 / 0.9), 0.0, True),
    ],
)
def test_k1_penalty_is_importance_weighted_and_clipped_with_the_reward(
    logp: float, ref: float, loss: float, grad: float, clipped: bool
) -> None:
    params = LossParams(kl_coef=0.1, kl_estimator="k1")
    logp_BT = torch.tensor([[math.log(logp)]], dtype=torch.float64, requires_grad=True)
    loss_BT, stats = token_loss(
        logp_BT,
        torch.tensor([[math.log(0.5)]], dtype=torch.float64),
        torch.tensor([0.0], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
        params,
        torch.tensor([[math.log(ref)]], dtype=torch.float64),
    )
    loss_BT.sum().backward()
    assert logp_BT.grad is not None
    assert loss_BT.item() == pytest.approx(loss, abs=1e-12)
    assert logp_BT.grad.item() == pytest.approx(grad, abs=1e-12)
    assert bool(stats.clipped_BT.item()) is clipped
    # The reported KL is the estimator's value, k1 = log(pi / ref).
    assert stats.kl_BT.item() == pytest.approx(math.log(logp / ref), abs=1e-12)


def test_k1_penalty_adds_to_the_advantage_of_every_token_separately() -> None:
    # Two tokens of one sample (A = 1) at r = 1 with k1 = log 2 and k1 = 0: advantages
    # 1 - 0.5 * log 2 and 1, so gradients -(1 - 0.5 log 2) and -1, losses the same.
    params = LossParams(kl_coef=0.5, kl_estimator="k1")
    logp_BT = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)).requires_grad_(True)
    loss_BT, _ = token_loss(
        logp_BT,
        logp_BT.detach(),
        torch.tensor([1.0], dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.bool),
        params,
        torch.log(torch.tensor([[0.25, 0.5]], dtype=torch.float64)),
    )
    loss_BT.sum().backward()
    assert logp_BT.grad is not None
    want = torch.tensor([[-(1 - 0.5 * math.log(2.0)), -1.0]], dtype=torch.float64)
    assert torch.allclose(loss_BT, want, atol=1e-12)
    assert torch.allclose(logp_BT.grad, want, atol=1e-12)
