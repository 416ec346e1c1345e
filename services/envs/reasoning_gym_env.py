"""``reasoning_gym:<task>``: a procedural task of the reasoning-gym library.

The library makes the task and judges the answer: ``create_dataset(task, seed=seed,
size=size, **env_args)`` generates entry ``i`` from the run's seed and ``i`` alone (prompt
``i`` of the run is entry ``i mod size``), and the entry's own ``score_answer`` is the reward,
in [0, 1]. The split is plexrl's, by the question's text (see :mod:`~.base`).

A prompt is the question as a user message, after ``system_prompt`` when one is set (its
text, for a tokenizer without a chat template, is the two one after the other): a key
of ``reasoning_gym.utils.SYSTEM_PROMPTS`` (``"default"``, ``"direct"``, ...) or a text of its
own. Those prompts ask for the answer between ``<answer>`` tags, so with a system prompt the
answer scored is the last tagged one (none found scores 0); without, it is the completion's
first line, as the built-ins read it, which suits a small model with no chat template that
continues the question's text.

Needs the ``reasoning-gym`` extra (``pip install 'plexrl[reasoning-gym]'``).
"""

from __future__ import annotations

from typing import Any

from services.envs.base import Environment, Message, Prompt, answer_of

DEFAULT_SIZE = 10_000
"""Entries per seed: prompts repeat past it. Some tasks draw their entries at construction, so
the size is bounded; ten thousand outlasts a run's training prompts."""


class ReasoningGymEnv(Environment):
    """One reasoning-gym task, seeded by the run, scored by the library."""

    def __init__(
        self,
        task: str,
        seed: int = 0,
        *,
        system_prompt: str | None = None,
        size: int = DEFAULT_SIZE,
        **task_config: Any,
    ) -> None:
        import reasoning_gym
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        super().__init__(seed)
        self.name = f"reasoning_gym:{task}"
        self.task = task
        self.size = size
        self.dataset = reasoning_gym.create_dataset(task, seed=seed, size=size, **task_config)
        self.system_prompt = SYSTEM_PROMPTS.get(system_prompt or "", system_prompt)

    def prompt(self, index: int) -> Prompt:
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        entry = self.dataset[index % self.size]
        question = str(entry["question"])
        messages: list[Message] = [{"role": "user", "content": question}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Prompt.chat(messages, target=str(entry["answer"]), info=entry)

    def score(self, prompt: Prompt, completion_text: str) -> float:
        from reasoning_gym.utils import extract_answer

        if self.system_prompt:
            answer = extract_answer(completion_text)
        else:
            answer = answer_of(completion_text).strip()
        return float(self.dataset.score_answer(answer, dict(prompt.info)))


def reasoning_gym_env(task: str, seed: int = 0, **env_args: Any) -> ReasoningGymEnv:
    """The factory behind ``env = "reasoning_gym:<task>"``."""
    return ReasoningGymEnv(task, seed, **env_args)
