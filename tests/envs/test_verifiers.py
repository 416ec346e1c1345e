"""verifiers environments: an in-memory taskset's own rewards score plexrl's completions.

Skipped where the ``verifiers`` extra is not installed (it is not part of ``dev``: see
pyproject.toml).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from services.envs import EnvLoadError, load_environment, prompt_token_ids, score_completion

vf = pytest.importorskip("verifiers.v1")

from services.envs.verifiers_env import VerifiersEnv  # noqa: E402
from tests.envs.vf_tasks import QAConfig, QASet  # noqa: E402

ROWS = [(f"what is {a} plus {b}?", str(a + b)) for a in range(20) for b in range(10)]


def qa_env(seed: int = 0, rows: list[tuple[str, str]] = ROWS, **config: Any) -> VerifiersEnv:
    return VerifiersEnv(QASet(QAConfig(rows=rows, **config)), seed)


def test_prompts_are_the_tasks_in_an_order_the_seed_decides() -> None:
    env = qa_env(seed=3)
    first_pass = [env.prompt(i) for i in range(len(ROWS))]
    assert sorted(p.text for p in first_pass) == sorted(q for q, _ in ROWS)  # each task once
    assert [p.text for p in first_pass] == [qa_env(seed=3).prompt(i).text for i in range(len(ROWS))]
    assert [p.text for p in first_pass] != [qa_env(seed=4).prompt(i).text for i in range(len(ROWS))]
    second_pass = [env.prompt(len(ROWS) + i).text for i in range(len(ROWS))]
    assert sorted(second_pass) == sorted(p.text for p in first_pass)
    assert second_pass != [p.text for p in first_pass]  # reshuffled for the next pass
    prompt = first_pass[0]
    assert dict(ROWS)[prompt.text] == prompt.target
    assert prompt.messages == ({"role": "user", "content": prompt.text},)


def test_the_tasks_rewards_score_a_completion_as_their_weighted_mean() -> None:
    env = qa_env()
    prompt = next(env.prompt(i) for i in range(50) if len(env.prompt(i).target) == 2)
    assert env.score(prompt, prompt.target) == 1.0  # correct (1) and brief (0.5): 1.5 / 1.5
    assert env.score(prompt, "no idea") == pytest.approx(0.5 / 1.5)  # brief only
    assert env.score(prompt, f"I think it is {prompt.target}") == 0.0  # wrong form, long
    assert env.score(prompt, f"  {prompt.target}\n") == 1.0  # verifiers strips the reply


def test_scoring_works_inside_a_running_event_loop() -> None:
    env = qa_env()
    prompt = env.prompt(0)

    async def inside() -> float:
        return env.score(prompt, prompt.target)

    assert asyncio.run(inside()) == 1.0


def test_a_system_prompt_comes_first_and_chat_models_get_the_template(chat_tokenizer: Any) -> None:
    env = qa_env(rows=ROWS[:5], system_prompt_text="Reply with the number only.")
    prompt = env.prompt(0)
    assert prompt.messages is not None
    assert [m["role"] for m in prompt.messages] == ["system", "user"]
    assert prompt.text == f"Reply with the number only.\n{prompt.messages[1]['content']}"
    rendered = chat_tokenizer.decode(prompt_token_ids(chat_tokenizer, prompt))
    assert rendered.startswith("<|im_start|>system\nReply with the number only.<|im_end|>\n")
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    reply = [*chat_tokenizer.encode(prompt.target, add_special_tokens=False), im_end]
    assert score_completion(env, chat_tokenizer, prompt, reply) == 1.0


def test_held_out_and_training_prompts_are_disjoint() -> None:
    env = qa_env(seed=5)
    heldout = env.heldout_prompts(10)
    train = [env.train_prompt(i) for i in range(len(ROWS))]
    assert len(heldout) == 10 and all(env.is_heldout(p) for p in heldout)
    assert not {p.text for p in heldout} & {p.text for p in train}


def test_an_installed_taskset_loads_by_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = Path(__file__).with_name("vf_tasks.py").read_text()
    (tmp_path / "plexrl_qa_taskset.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("verifiers:plexrl_qa_taskset", seed=0, rows=ROWS[:30], max_tasks=20)
    assert isinstance(env, VerifiersEnv) and env.name == "verifiers:plexrl_qa_taskset"
    assert len(env.tasks) == 20
    prompt = env.prompt(0)
    assert env.score(prompt, prompt.target) == 1.0
    with pytest.raises(EnvLoadError, match="rows"):
        load_environment("verifiers:plexrl_qa_taskset", seed=0, rows="not rows")
    with pytest.raises(EnvLoadError, match="no_such_taskset"):
        load_environment("verifiers:no_such_taskset", seed=0)


def test_tasks_plexrl_cannot_play_are_refused() -> None:
    with pytest.raises(ValueError, match="no tasks"):
        qa_env(rows=[])

    class Endless(QASet):
        INFINITE = True

    with pytest.raises(ValueError, match="max_tasks"):
        VerifiersEnv(Endless(QAConfig(rows=ROWS)), 0)
    assert len(VerifiersEnv(Endless(QAConfig(rows=ROWS)), 0, max_tasks=7).tasks) == 7
