"""What an environment is: a seeded, indexable prompt source and a scorer.

A run's position in its environment is a single integer, the index of the next prompt: prompt
``i`` depends only on the environment's seed and ``i``, never on which prompts were drawn
before, so resuming a run means remembering that integer.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass

PROMPT_CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?+-*/=()[]<>'\"_#@"
"""Every character a built-in prompt or target uses; the tiny model's tokenizer covers them."""


@dataclass(frozen=True)
class Prompt:
    """A task instance: the text the model continues and the answer a perfect model writes."""

    text: str
    target: str


class Environment(ABC):
    """A task a run learns: prompts by index, and a reward in [0, 1] for a completion.

    ``score`` receives the completion decoded without special tokens, so generation that
    ended on the end-of-sequence token simply ends the text. Built-ins read the answer up to
    the first newline.
    """

    name: str

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    @abstractmethod
    def prompt(self, index: int) -> Prompt:
        """Prompt number ``index`` (>= 0); the same for the same seed and index, always."""

    @abstractmethod
    def score(self, prompt: Prompt, completion_text: str) -> float:
        """The reward of ``completion_text`` as an answer to ``prompt``, in [0, 1]."""

    def rng(self, index: int) -> random.Random:
        """A generator for prompt ``index`` alone.

        Seeded with a string, which ``random`` hashes with SHA-512, so the stream is the same in
        every process whatever ``PYTHONHASHSEED`` is.
        """
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        return random.Random(f"{self.name}:{self.seed}:{index}")


def answer_of(completion_text: str) -> str:
    """The part of a completion the built-ins score: everything before the first newline."""
    return completion_text.split("\n", 1)[0]


def position_accuracy(answer: str, target: str) -> float:
    """Characters in the right place over ``max(len(answer), len(target))``.

    Dividing by the longer of the two makes every extra character cost as much as a wrong one,
    so rambling past the answer is never free.
    """
    longest = max(len(answer), len(target))
    if longest == 0:
        return 1.0
    return sum(a == t for a, t in zip(answer, target, strict=False)) / longest
