"""The pure parts of held-out evaluation and dynamic sampling: pass@k, the base's best
temperature, when evaluations happen, and which groups a dynamically sampled batch keeps."""

from __future__ import annotations

from typing import Any

import pytest

from schemas.config import ConfigError, orch_config_from_dict
from services.envs import load_environment
from services.orchestrator import rollouts
from services.orchestrator.evaluation import (
    BaseEval,
    base_key,
    eval_due,
    mean_pass_at_k,
    pass_at_k,
    read_base,
    write_base,
)
from services.orchestrator.rollouts import PlannedPrompt, ScoredGroup

from .conftest import orch_config


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
        (4, 0, 4, 0.0),
        (4, 3, 2, 1.0),  # fewer than k unsolved: every k-subset holds a solved one
        (8, 3, 1, 3 / 8),  # pass@1 is the solved fraction
        (4, 4, 4, 1.0),
    ],
)
def test_pass_at_k_matches_hand_computed_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 2), (4, -1, 2), (4, 1, 5), (4, 1, 0)])
def test_pass_at_k_rejects_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="need 0 <= c <= n and 1 <= k <= n"):
        pass_at_k(n, c, k)


def test_mean_pass_at_k_counts_only_exact_answers() -> None:
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.99, 0.99, 0.99, 0.99], [1.0, 1.0, 1.0, 0.2]]
    assert mean_pass_at_k(rewards, 2) == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    with pytest.raises(ValueError, match="no prompts"):
        mean_pass_at_k([], 2)


def test_base_best_picks_the_best_temperature(tmp_path: Any) -> None:
    base = BaseEval({0.0: 0.31, 0.1: 0.42, 0.5: 0.40, 1.0: 0.12})
    assert (base.best, base.best_temperature) == (0.42, 0.1)
    assert base.fields() == {"base_greedy": 0.31, "base_best": 0.42, "base_best_temperature": 0.1}
    tie = BaseEval({1.0: 0.5, 0.0: 0.5, 0.5: 0.2})
    assert tie.best_temperature == 0.0  # a tie goes to the lowest temperature
    path = tmp_path / "heldout_base.json"
    key = base_key(orch_config())
    write_base(path, base, key)
    assert read_base(path, key) == base
    assert read_base(path, base_key(orch_config(seed=8))) is None  # another config
    path.write_text("{not json")
    assert read_base(path) is None  # measured again rather than trusted
    assert read_base(tmp_path / "missing.json") is None


def test_eval_steps_are_every_interval_and_the_last() -> None:
    config = orch_config(max_steps=25, eval={"interval": 10})
    assert [s for s in range(25) if eval_due(s, config)] == [9, 19, 24]
    off = orch_config(max_steps=25, eval={"interval": 0})
    assert not any(eval_due(s, off) for s in range(25))


@pytest.mark.parametrize(
    ("eval_table", "message"),
    [
        ({"samples": 2, "pass_k": 4}, "samples (2) must be >= pass_k (4)"),
        ({"base_temperatures": [0.0, 1.0]}, "each base temperature must be in (0, 10]"),
        ({"interval": -1}, "eval.interval"),
        ({"num_prompts": 0}, "eval.num_prompts"),
        ({"intervall": 5}, "eval.intervall: unknown key"),
    ],
)
def test_bad_eval_config_says_what_is_wrong(eval_table: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        orch_config_from_dict({"eval": eval_table})
    assert message in str(info.value)


def _group(index: int, rewards: list[float]) -> ScoredGroup:
    env = load_environment("reverse", seed=0)
    planned = PlannedPrompt(index, env.train_prompt(index), [1, 2, 3])
    return ScoredGroup(planned, [], rewards, 0)


def test_fill_groups_drops_zero_spread_groups_and_stops_at_the_batch_size() -> None:
    candidates = [
        _group(0, [0.0, 0.0]),
        _group(1, [0.0, 1.0]),
        _group(2, [1.0, 1.0]),
        _group(3, [0.5, 0.25]),
        _group(4, [0.2, 0.3]),
    ]
    kept, dropped = rollouts.fill_groups([], candidates, 2)
    assert [g.planned.index for g in kept] == [1, 3]
    assert [g.planned.index for g in dropped] == [0, 2]
    more, dropped2 = rollouts.fill_groups(kept[:1], [_group(9, [0.3, 0.3]), _group(8, [0, 1])], 3)
    assert [g.planned.index for g in more] == [1, 8]
    assert [g.planned.index for g in dropped2] == [9]
    topped = rollouts.top_up(more, dropped + dropped2, 4)
    assert [g.planned.index for g in topped] == [1, 8, 0, 2]
    assert rollouts.top_up(more, dropped, 2) == more


def test_refill_prompts_are_stable_training_prompts_apart_from_the_steps() -> None:
    env = load_environment("reverse", seed=0)
    a = rollouts.plan_refill(env, _Tok(), 3, 1, 4)
    assert [p.index for p in a] == [p.index for p in rollouts.plan_refill(env, _Tok(), 3, 1, 4)]
    assert len({p.index for p in a}) == 4 and all(p.index >= 2**40 for p in a)
    assert {p.index for p in a}.isdisjoint(
        p.index for p in rollouts.plan_refill(env, _Tok(), 3, 2, 4)
    )
    assert not any(env.is_heldout(p.prompt) for p in a)
    with pytest.raises(ValueError, match="no refill prompt"):
        rollouts.refill_index(3, 0, 1)


class _Tok:
    bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]
