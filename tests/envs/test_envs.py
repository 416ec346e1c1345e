"""Environments: seeded, resumable prompts; hand-checked rewards; plugin loading."""

from __future__ import annotations

import random
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.envs import (
    BUILTIN_ENVS,
    PROMPT_CHARACTERS,
    AddEnv,
    CopyEnv,
    Environment,
    EnvLoadError,
    Prompt,
    ReverseEnv,
    RotateEnv,
    UpperEnv,
    load_environment,
)


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_same_seed_same_prompts_other_seed_other_prompts(name: str) -> None:
    a = [load_environment(name, seed=3).prompt(i) for i in range(30)]
    b = [load_environment(name, seed=3).prompt(i) for i in range(30)]
    c = [load_environment(name, seed=4).prompt(i) for i in range(30)]
    assert a == b
    assert sum(x != y for x, y in zip(a, c, strict=True)) >= 20
    assert len(set(a)) >= 15  # not one prompt repeated


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_prompt_depends_only_on_the_index(name: str) -> None:
    env = load_environment(name, seed=11)
    forward = {i: env.prompt(i) for i in range(40)}
    order = list(range(40))
    random.Random(0).shuffle(order)
    resumed = load_environment(name, seed=11)
    assert {i: resumed.prompt(i) for i in order} == forward
    assert resumed.prompt(25) == forward[25]  # asked twice, same answer


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_prompts_use_the_shared_character_set_and_targets_score_one(name: str) -> None:
    env = load_environment(name, seed=0)
    for i in range(200):
        p = env.prompt(i)
        assert set(p.text + p.target) <= set(PROMPT_CHARACTERS)
        assert env.score(p, p.target) == 1.0
        assert env.score(p, p.target + "\nanything after the newline") == 1.0
        assert env.score(p, "") == 0.0


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_random_output_scores_near_zero(name: str) -> None:
    env = load_environment(name, seed=0)
    rng = random.Random(0)
    chars = PROMPT_CHARACTERS + "\n"
    scores = [
        env.score(env.prompt(i), "".join(rng.choice(chars) for _ in range(16))) for i in range(300)
    ]
    assert sum(scores) / len(scores) < 0.05


def test_builtin_prompt_formats() -> None:
    rev, cp, add = ReverseEnv(seed=0), CopyEnv(seed=0), AddEnv(seed=0)
    for i in range(100):
        r = rev.prompt(i)
        word = r.text.removeprefix("reverse: ").removesuffix("=")
        assert r.text == f"reverse: {word}=" and r.target == word[::-1]
        assert 3 <= len(word) <= 5 and word.isalpha() and word.islower()
        c = cp.prompt(i)
        word = c.text.removeprefix("copy: ").removesuffix("=")
        assert c.target == word and 3 <= len(word) <= 5
        a = add.prompt(i)
        x, y = a.text.removeprefix("add: ").removesuffix("=").split("+")
        assert 0 <= int(x) <= 99 and 0 <= int(y) <= 9 and a.target == str(int(x) + int(y))
    sums = {add.prompt(i).text for i in range(5000)}
    assert len(sums) > 900  # enough distinct prompts for a held-out split of ~100


def test_reverse_and_copy_exact_answers_earn_twice_any_near_miss() -> None:
    rev = ReverseEnv()
    p = Prompt(text="reverse: abcd=", target="dcba")
    assert rev.score(p, "dcba") == 1.0
    assert rev.score(p, "dcbx") == 0.375
    assert rev.score(p, "dcb") == 0.375  # the warm start's slip: one letter short
    assert rev.score(p, "dc") == 0.25
    assert rev.score(p, "dcbaaa") == pytest.approx(2 / 6)  # extra characters cost
    assert rev.score(p, "abcd") == 0.0  # copying does not solve reverse
    assert rev.score(p, " dcba") == 0.0  # shifted by one: nothing in place
    assert rev.score(p, "dcb\na") == 0.375
    assert rev.score(p, "dcba\nmore") == 1.0
    cp = CopyEnv()
    q = Prompt(text="copy: abcde=", target="abcde")
    assert cp.score(q, "abcde") == 1.0
    assert cp.score(q, "edcba") == 0.1  # only the middle letter
    assert cp.score(q, "abc") == 0.3


def test_slips_are_the_plausible_mistakes_the_warm_start_shows() -> None:
    rev, cp, add = ReverseEnv(seed=0), CopyEnv(seed=0), AddEnv(seed=0)
    assert rev.slip(Prompt(text="reverse: abcd=", target="dcba")) == "dcb"
    assert cp.slip(Prompt(text="copy: abcde=", target="abcde")) == "abcd"
    assert cp.slip(Prompt(text="copy: a=", target="a")) is None  # nothing left to drop
    carry = Prompt(text="add: 47+8=", target="55")
    assert add.slip(carry) == "45"  # the carry forgotten
    assert add.score(carry, "45") == pytest.approx(0.2)
    assert add.slip(Prompt(text="add: 95+7=", target="102")) == "92"
    assert add.slip(Prompt(text="add: 41+3=", target="44")) == "44"  # no carry: no mistake
    assert add.slip(Prompt(text="add: 0+0=", target="0")) == "0"
    for i in range(200):  # a slip is wrong exactly when the sum carries
        p = add.prompt(i)
        a, b = (int(n) for n in p.text.removeprefix("add: ").removesuffix("=").split("+"))
        assert (add.slip(p) != p.target) == (a % 10 + b >= 10)
        assert rev.slip(rev.prompt(i)) == rev.prompt(i).target[:-1]


def test_upper_and_rotate_prompts_scores_and_slips() -> None:
    up, rot = UpperEnv(seed=0), RotateEnv(seed=0)
    for i in range(100):
        u = up.prompt(i)
        word = u.text.removeprefix("upper: ").removesuffix("=")
        assert u.target == word.upper() and 3 <= len(word) <= 5 and word.islower()
        assert up.slip(u) == word[:-1].upper() + word[-1]  # the last letter left lowercase
        r = rot.prompt(i)
        word = r.text.removeprefix("rotate: ").removesuffix("=")
        assert r.target == word[1:] + word[0] and 3 <= len(word) <= 5
        assert rot.slip(r) == r.target[:-1]  # stops one letter early
    p = Prompt(text="upper: abcd=", target="ABCD")
    assert up.score(p, "ABCD") == 1.0
    assert up.score(p, "ABCd") == 0.375  # the slip: one letter of four wrong
    assert up.score(p, "abcd") == 0.0  # copying is not upper-casing
    assert up.score(p, "ABCDX") == 0.4
    q = Prompt(text="rotate: abcd=", target="bcda")
    assert rot.score(q, "bcda") == 1.0
    assert rot.score(q, "bcd") == 0.375
    assert rot.score(q, "abcd") == 0.0  # copying is not rotating
    assert up.slip(Prompt(text="upper: a=", target="A")) == "a"
    assert {up.prompt(i).text for i in range(5000)}.__len__() > 4500  # thousands of prompts


def test_add_partial_credit() -> None:
    env = AddEnv()
    seven = Prompt(text="add: 3+4=", target="7")
    assert env.score(seven, "7") == 1.0
    assert env.score(seven, "8") == pytest.approx(0.2 + 0.3 * 0.9)
    assert env.score(seven, "3") == pytest.approx(0.2 + 0.3 * 0.6)
    assert env.score(seven, "7xx") == pytest.approx(1 / 3)
    assert env.score(seven, "17") == 0.0  # wrong length and 10 away
    assert env.score(seven, "07") == pytest.approx(0.3)  # right value, wrong digit count
    assert env.score(seven, "x7") == 0.0
    twelve = Prompt(text="add: 5+7=", target="12")
    assert env.score(twelve, "12") == 1.0
    assert env.score(twelve, "13") == pytest.approx(0.2 + 0.3 * 0.9)
    assert env.score(twelve, "2") == 0.0
    assert env.score(twelve, "12\n") == 1.0


def test_env_args_are_passed_to_the_builtin() -> None:
    env = load_environment("reverse", seed=1, min_len=7, max_len=7)
    assert isinstance(env, ReverseEnv)
    assert all(len(env.prompt(i).target) == 7 for i in range(20))
    wide = load_environment("add", seed=1, max_operand=99)
    assert max(len(wide.prompt(i).target) for i in range(50)) >= 2


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Iterator[Path]:
    pkg = tmp_path / "plexrl_test_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tasks.py").write_text(
        textwrap.dedent(
            """
            from services.envs import Environment, Prompt

            class Echo(Environment):
                name = "echo"

                def __init__(self, seed=0, *, word="hi"):
                    super().__init__(seed)
                    self.word = word

                def prompt(self, index):
                    return Prompt(text=f"say {self.word} {index}:", target=self.word)

                def score(self, prompt, completion_text):
                    return float(completion_text == prompt.target)

            def make(seed, word="yo"):
                return Echo(seed, word=word)

            def not_an_env(seed):
                return {"seed": seed}

            NOT_CALLABLE = 3

            class Nameless(Echo):
                name = ""
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for mod in [m for m in sys.modules if m.startswith("plexrl_test_plugin")]:
        del sys.modules[mod]


def test_plugin_loads_from_module_path(plugin_dir: Path) -> None:
    env = load_environment("plexrl_test_plugin.tasks:make", seed=5, word="ok")
    assert isinstance(env, Environment) and env.name == "echo" and env.seed == 5
    assert env.prompt(2) == Prompt(text="say ok 2:", target="ok")
    assert env.score(env.prompt(0), "ok") == 1.0
    cls_env = load_environment("plexrl_test_plugin.tasks:Echo", seed=0)
    assert cls_env.prompt(0).target == "hi"


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        (
            "revers",
            {},
            "unknown environment 'revers': use a built-in (add, copy, reverse, rotate, upper)",
        ),
        ("nosuch_pkg_xyz.mod:f", {}, "cannot import module 'nosuch_pkg_xyz.mod'"),
        (":f", {}, "is not of the form 'package.module:factory'"),
        ("plexrl_test_plugin.tasks:", {}, "is not of the form 'package.module:factory'"),
        (
            "plexrl_test_plugin.tasks:missing",
            {},
            "module 'plexrl_test_plugin.tasks' has no 'missing'",
        ),
        ("plexrl_test_plugin.tasks:NOT_CALLABLE", {}, "is a int, not a callable factory"),
        ("plexrl_test_plugin.tasks:not_an_env", {}, "returned dict, not an Environment"),
        ("plexrl_test_plugin.tasks:Nameless", {}, "has no name"),
        (
            "reverse",
            {"colour": "red"},
            "environment 'reverse' rejected seed=0 env_args={'colour': 'red'}",
        ),
        ("reverse", {"min_len": 6, "max_len": 2}, "need 1 <= min_len <= max_len"),
    ],
)
def test_bad_specs_say_what_is_wrong(
    plugin_dir: Path, spec: str, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(EnvLoadError) as info:
        load_environment(spec, 0, **kwargs)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_negative_index_is_rejected() -> None:
    with pytest.raises(ValueError, match="prompt index must be >= 0"):
        ReverseEnv().prompt(-1)


def test_a_missing_environment_library_names_the_extra_that_installs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.envs import LIBRARY_ENVS

    target = "services.envs.verifiers_env:verifiers_env"
    monkeypatch.setitem(LIBRARY_ENVS, "plexrl_absent_library", (target, "absent"))
    with pytest.raises(EnvLoadError, match=r"pip install 'plexrl\[absent\]'"):
        load_environment("plexrl_absent_library:task", seed=0)
