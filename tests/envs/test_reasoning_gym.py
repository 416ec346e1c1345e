"""``reasoning_gym:<task>``: the library's own generator and scorer behind plexrl's interface,
on two of its procedural tasks."""

from __future__ import annotations

from typing import Any

import pytest

from services.envs import EnvLoadError, load_environment, prompt_token_ids, score_completion
from services.envs.reasoning_gym_env import ReasoningGymEnv

reasoning_gym = pytest.importorskip("reasoning_gym")

TASKS = ["basic_arithmetic", "spell_backward"]


@pytest.mark.parametrize("task", TASKS)
def test_prompts_are_the_librarys_and_depend_on_the_seed(task: str) -> None:
    env = load_environment(f"reasoning_gym:{task}", seed=7)
    assert isinstance(env, ReasoningGymEnv) and env.name == f"reasoning_gym:{task}"
    again = load_environment(f"reasoning_gym:{task}", seed=7)
    other = load_environment(f"reasoning_gym:{task}", seed=8)
    first = [env.prompt(i) for i in range(20)]
    assert [(p.text, p.target) for p in first] == [
        (again.prompt(i).text, again.prompt(i).target) for i in range(20)
    ]
    assert [p.text for p in first] != [other.prompt(i).text for i in range(20)]
    # entry i of the library's dataset with the same seed, question and answer as they are
    library = reasoning_gym.create_dataset(task, seed=7, size=env.size)
    assert [(p.text, p.target) for p in first] == [
        (library[i]["question"], library[i]["answer"]) for i in range(20)
    ]
    assert first[3].messages == ({"role": "user", "content": library[3]["question"]},)
    assert env.prompt(env.size + 3).text == first[3].text  # past the size, entries repeat


@pytest.mark.parametrize("task", TASKS)
def test_the_librarys_scorer_prefers_the_librarys_answer(task: str) -> None:
    env = load_environment(f"reasoning_gym:{task}", seed=3)
    for i in range(10):
        prompt = env.prompt(i)
        assert env.score(prompt, prompt.target) == 1.0
        assert env.score(prompt, prompt.target + "\nthen some chatter") == 1.0  # first line
        assert env.score(prompt, "x" + prompt.target) < 1.0
        assert env.score(prompt, "") < 1.0


def test_a_system_prompt_asks_for_tagged_answers_and_only_those_count() -> None:
    env = load_environment("reasoning_gym:basic_arithmetic", seed=0, system_prompt="direct")
    prompt = env.prompt(0)
    system = reasoning_gym.utils.SYSTEM_PROMPTS["direct"]
    assert prompt.messages is not None and prompt.messages[0] == {
        "role": "system",
        "content": system,
    }
    assert prompt.text == f"{system}\n{prompt.messages[1]['content']}"
    assert env.score(prompt, f"Let me think.\n<answer>{prompt.target}</answer>") == 1.0
    assert env.score(prompt, prompt.target) == 0.0  # no tags, no answer
    custom = load_environment("reasoning_gym:basic_arithmetic", seed=0, system_prompt="Be terse.")
    assert custom.prompt(0).messages[0]["content"] == "Be terse."  # type: ignore[index]


@pytest.mark.parametrize("task", TASKS)
def test_held_out_and_training_prompts_are_disjoint(task: str) -> None:
    env = load_environment(f"reasoning_gym:{task}", seed=1)
    heldout = env.heldout_prompts(20)
    train = [env.train_prompt(i) for i in range(400)]
    assert len(heldout) == 20 and all(env.is_heldout(p) for p in heldout)
    assert not any(env.is_heldout(p) for p in train)
    assert not {p.text for p in heldout} & {p.text for p in train}
    assert env.heldout_prompts(20) == heldout


def test_task_settings_reach_the_librarys_config() -> None:
    env = load_environment(
        "reasoning_gym:basic_arithmetic",
        seed=0,
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=1,
    )
    for i in range(20):
        question = env.prompt(i).text
        digits = [c for c in question if c.isdigit()]
        assert 2 <= len(digits) <= 2, question


def test_unknown_tasks_and_settings_are_load_errors() -> None:
    with pytest.raises(EnvLoadError, match="not registered"):
        load_environment("reasoning_gym:no_such_task", seed=0)
    with pytest.raises(EnvLoadError, match="no_such_setting"):
        load_environment("reasoning_gym:basic_arithmetic", seed=0, no_such_setting=1)
    with pytest.raises(EnvLoadError, match="names no task"):
        load_environment("reasoning_gym:", seed=0)


def test_a_chat_model_sees_the_question_in_its_template(chat_tokenizer: Any) -> None:
    env = load_environment("reasoning_gym:spell_backward", seed=0)
    prompt = env.prompt(0)
    rendered = chat_tokenizer.decode(prompt_token_ids(chat_tokenizer, prompt))
    assert rendered == f"<|im_start|>user\n{prompt.text}<|im_end|>\n<|im_start|>assistant\n"
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    reply = [*chat_tokenizer.encode(prompt.target, add_special_tokens=False), im_end]
    assert score_completion(env, chat_tokenizer, prompt, reply) == 1.0
