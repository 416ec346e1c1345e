"""The held-out split: disjoint from every training prompt, stable, and loud when it cannot exist."""

from __future__ import annotations

import pytest

from services.envs import BUILTIN_ENVS, Environment, Prompt, SplitError, load_environment
from services.envs.base import MAX_DRAWS


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_training_and_heldout_prompts_are_disjoint(name: str) -> None:
    env = load_environment(name, seed=1)
    train = {env.train_prompt(i).text for i in range(5000)}
    heldout = {p.text for p in env.heldout_prompts(500)}
    assert train and heldout
    assert not train & heldout
    # the split is a property of the text: another seed's training prompts avoid it too
    other = load_environment(name, seed=2)
    assert not {other.train_prompt(i).text for i in range(2000)} & heldout
    assert all(env.is_heldout(Prompt(t, "")) for t in heldout)
    assert not any(env.is_heldout(Prompt(t, "")) for t in train)


@pytest.mark.parametrize(("name", "distinct"), [("reverse", 1000), ("copy", 1000), ("add", 1000)])
def test_split_sizes(name: str, distinct: int) -> None:
    """About a tenth of the prompt texts are held out. ``add`` has 1,000 distinct prompts
    (two digits plus one), so its held-out split holds about 100 distinct sums (64 held-out
    prompts hold some twice)."""
    env = load_environment(name, seed=0)
    texts = {env.prompt(i).text for i in range(20000)}
    assert len(texts) >= distinct
    held = {t for t in texts if env.is_heldout(Prompt(t, ""))}
    assert 0.05 < len(held) / len(texts) < 0.2
    if name == "add":
        assert len(texts) == 1000 and 80 < len(held) < 130
        assert {p.text for p in env.heldout_prompts(1000)} == held


def test_training_prompts_are_the_raw_prompts_outside_the_split() -> None:
    env = load_environment("reverse", seed=7)
    replaced = 0
    for i in range(300):
        raw, train = env.prompt(i), env.train_prompt(i)
        if env.is_heldout(raw):
            replaced += 1
            assert train != raw and not env.is_heldout(train)
            assert env.train_prompt(i) == train  # the replacement is stable
        else:
            assert train == raw
    assert replaced > 0
    assert env.heldout_prompts(20) == load_environment("reverse", seed=7).heldout_prompts(20)
    assert env.heldout_prompts(5) == env.heldout_prompts(20)[:5]


class _Constant(Environment):
    name = "constant"

    def __init__(self, seed: int = 0, *, text: str = "say ok:") -> None:
        super().__init__(seed)
        self.text = text

    def prompt(self, index: int) -> Prompt:
        return Prompt(self.text, "ok")

    def score(self, prompt: Prompt, completion_text: str) -> float:
        return float(completion_text == "ok")


def _constant(heldout: bool) -> _Constant:
    for k in range(1000):
        env = _Constant(text=f"say ok {k}:")
        if env.is_heldout(env.prompt(0)) == heldout:
            return env
    raise AssertionError("no such text")


def test_an_env_whose_only_prompt_is_held_out_cannot_train() -> None:
    env = _constant(heldout=True)
    with pytest.raises(SplitError, match=f"no training prompt in {MAX_DRAWS} draws"):
        env.train_prompt(3)
    assert env.heldout_prompts(2) == [env.prompt(0), env.prompt(1)]


def test_an_env_without_heldout_prompts_says_so() -> None:
    env = _constant(heldout=False)
    assert env.train_prompt(0) == env.prompt(0)
    with pytest.raises(SplitError, match="0 held-out prompts in its first"):
        env.heldout_prompts(1)

    class NoSplit(_Constant):
        heldout_fraction = 0.0

    with pytest.raises(SplitError, match="holds no prompts out"):
        NoSplit().heldout_prompts(4)
    assert NoSplit().heldout_prompts(0) == []
    with pytest.raises(ValueError, match="count must be >= 0"):
        NoSplit().heldout_prompts(-1)
