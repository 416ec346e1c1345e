"""Group-relative advantages on hand numbers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from services.orchestrator.advantages import batch_advantages


def one_group(rewards_G: Sequence[float] | torch.Tensor, **kwargs: float | bool) -> torch.Tensor:
    """Advantages of a single group: a batch of one row."""
    rows = rewards_G.unsqueeze(0) if isinstance(rewards_G, torch.Tensor) else [list(rewards_G)]
    return batch_advantages(rows, **kwargs)[0]  # type: ignore[arg-type]


def test_mean_centred() -> None:
    got = one_group([1.0, 0.0, 0.5, 0.5])
    assert torch.equal(got, torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64))


def test_std_normalized_uses_population_std() -> None:
    # rewards 0, 0, 1, 1: mean 0.5, population std 0.5.
    got = one_group([0.0, 0.0, 1.0, 1.0], std_normalize=True, eps=1e-6)
    assert torch.allclose(
        got, torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=torch.float64) * 0.5 / (0.5 + 1e-6)
    )
    # Three rewards 1, 2, 6: mean 3, std sqrt(14/3).
    got = one_group(torch.tensor([1.0, 2.0, 6.0]), std_normalize=True, eps=0.1)
    std = (14 / 3) ** 0.5
    assert torch.allclose(got, torch.tensor([-2.0, -1.0, 3.0]) / (std + 0.1))
    assert got.dtype == torch.float32
    # the default eps is 1e-6
    assert torch.equal(
        one_group([0.0, 2.0], std_normalize=True),
        torch.tensor([-1.0, 1.0], dtype=torch.float64) / (1.0 + 1e-6),
    )


def test_each_group_is_normalised_by_its_own_std() -> None:
    # rewards 0, 2 (std 1) and 0, 8 (std 4): both groups come out at about -1, 1
    got = batch_advantages([[0.0, 2.0], [0.0, 8.0]], std_normalize=True, eps=1e-6)
    expected = [[-1 / (1 + 1e-6), 1 / (1 + 1e-6)], [-4 / (4 + 1e-6), 4 / (4 + 1e-6)]]
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_integer_rewards_are_taken_as_doubles() -> None:
    got = batch_advantages(torch.tensor([[1, 0, 0, 1]]))
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.tensor([[0.5, -0.5, -0.5, 0.5]], dtype=torch.float64))


@pytest.mark.parametrize("std_normalize", [False, True])
def test_equal_rewards_give_exactly_zero(std_normalize: bool) -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point; the group must still come out exactly zero.
    got = batch_advantages([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7]], std_normalize=std_normalize)
    assert torch.equal(got, torch.zeros(2, 3, dtype=torch.float64))
    assert torch.equal(
        one_group([0.3], std_normalize=std_normalize), torch.zeros(1, dtype=torch.float64)
    )


def test_batched_rows_are_independent_groups() -> None:
    got = batch_advantages([[1.0, 0.0], [0.2, 0.2], [3.0, 1.0]])
    assert torch.allclose(
        got, torch.tensor([[0.5, -0.5], [0.0, 0.0], [1.0, -1.0]], dtype=torch.float64)
    )
    assert torch.allclose(got[2], one_group([3.0, 1.0]))
    # Advantages of a group sum to zero.
    assert torch.allclose(
        batch_advantages(torch.rand(5, 8), std_normalize=True).sum(1), torch.zeros(5), atol=1e-5
    )


def test_invalid_rewards() -> None:
    with pytest.raises(
        ValueError, match=r"^rewards must be finite; an environment returned NaN or inf$"
    ):
        one_group([1.0, float("nan")])
    with pytest.raises(ValueError, match=r"shape \[P, G\]"):
        batch_advantages([1.0, 2.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"shape \[P, G\]"):
        batch_advantages([[]])
    with pytest.raises(ValueError, match="eps"):
        one_group([1.0, 2.0], eps=0.0)
