"""What an environment is: a seeded, indexable prompt source and a scorer.

A run's position in its environment is a single integer, the index of the next prompt: prompt
``i`` depends only on the environment's seed and ``i``, never on which prompts were drawn
before, so resuming a run means remembering that integer.

Two splits, disjoint by construction: the SHA-256 of a prompt's *text* decides its split
(held out when the first 8 bytes, read as an integer, fall in the lowest ``heldout_fraction`` of
the range), so the same text is in the same split for every seed, run and process.

- training prompt ``i`` (:meth:`Environment.train_prompt`) is ``prompt(i)`` when that is a
  training prompt, else the first training prompt among ``prompt(j)`` for a fixed sequence of
  indices ``j`` derived from ``i`` (at most ``MAX_DRAWS`` tries);
- held-out prompt ``i`` (:meth:`Environment.heldout_prompts`) is the ``i``-th held-out prompt of
  ``prompt(0), prompt(1), ...`` in order.

A plugin implements only :meth:`Environment.prompt` and :meth:`Environment.score` and gets both
splits; it may set ``heldout_fraction = 0`` to hold nothing out (then a run has no held-out
evaluation), or override :meth:`Environment.is_heldout` to use a split of its own.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PROMPT_CHARACTERS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?+-*/=()[]<>'\"_#@"
)
"""Every character a built-in prompt or target uses; the tiny model's tokenizer covers them."""

MAX_DRAWS = 10_000
"""Prompts tried before a split is declared empty: with a held-out fraction of 1/10, a split
that has prompts misses them all in 10,000 draws with probability below 1e-450."""

_HASH_RANGE = 1 << 64


class SplitError(ValueError):
    """An environment whose prompts cannot fill a split (too few distinct prompts)."""


Message = Mapping[str, str]
"""One chat message: ``{"role": "system" | "user" | "assistant", "content": str}``."""


@dataclass(frozen=True)
class Prompt:
    """A task instance: the text the model continues and the answer a perfect model writes.

    An environment for chat models also gives ``messages``; a tokenizer with a chat template
    renders those instead of ``text`` (see :func:`~.prompts.prompt_token_ids`). ``text`` stays
    the prompt's identity (its split is decided by it) and what a tokenizer without a template
    continues; built from ``messages`` it is their contents, one per line. ``info`` is the
    environment's own data for scoring (a library's task entry, say), opaque to everyone else.
    """

    text: str
    target: str
    messages: tuple[Message, ...] | None = field(default=None, hash=False)
    info: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.messages is None:
            return
        messages = tuple(_checked_message(m) for m in self.messages)
        if not messages:
            raise ValueError("a prompt's messages, when given, must not be empty")
        object.__setattr__(self, "messages", messages)
        if not self.text:
            object.__setattr__(self, "text", "\n".join(m["content"] for m in messages))

    @classmethod
    def chat(
        cls, messages: Sequence[Message], target: str, info: Mapping[str, Any] | None = None
    ) -> Prompt:
        """A prompt given as chat messages; its ``text`` is their contents, one per line."""
        return cls(text="", target=target, messages=tuple(messages), info=dict(info or {}))


class Environment(ABC):
    """A task a run learns: prompts by index, and a reward in [0, 1] for a completion.

    ``score`` receives the completion decoded without special tokens, so generation that
    ended on the end-of-sequence token simply ends the text. Built-ins read the answer up to
    the first newline.
    """

    name: str
    heldout_fraction: float = 0.1
    """Share of the prompt texts held out of training, in [0, 1)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    @abstractmethod
    def prompt(self, index: int) -> Prompt:
        """Prompt number ``index`` (>= 0); the same for the same seed and index, always."""

    @abstractmethod
    def score(self, prompt: Prompt, completion_text: str) -> float:
        """The reward of ``completion_text`` as an answer to ``prompt``, in [0, 1]."""

    def slip(self, prompt: Prompt) -> str | None:
        """A plausible wrong answer to ``prompt``: the mistake the warm start demonstrates.

        The tiny model's pre-training (:mod:`services.model.pretrain`) shows this answer instead
        of the right one in most demonstrations, so the base's most likely answer is wrong while
        the right one stays within reach of sampling: what RL then has to learn. ``None`` (the
        default) when the task has none, or none for this prompt.
        """
        return None

    def rng(self, index: int) -> random.Random:
        """A generator for prompt ``index`` alone.

        Seeded with a string, which ``random`` hashes with SHA-512, so the stream is the same in
        every process whatever ``PYTHONHASHSEED`` is.
        """
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        return random.Random(f"{self.name}:{self.seed}:{index}")

    def is_heldout(self, prompt: Prompt) -> bool:
        """Whether ``prompt`` belongs to the held-out split: decided by its text alone."""
        digest = hashlib.sha256(prompt.text.encode()).digest()
        return int.from_bytes(digest[:8], "big") < self.heldout_fraction * _HASH_RANGE

    def train_prompt(self, index: int) -> Prompt:
        """Training prompt ``index``: never a held-out prompt (see the module docstring)."""
        prompt = self.prompt(index)
        draws = 1
        while self.is_heldout(prompt):
            if draws >= MAX_DRAWS:
                raise SplitError(
                    f"environment {self.name!r}: no training prompt in {MAX_DRAWS} draws from "
                    f"index {index}; every prompt it makes is held out (lower heldout_fraction)"
                )
            prompt = self.prompt(_redraw_index(self.name, index, draws))
            draws += 1
        return prompt

    def heldout_prompts(self, count: int) -> list[Prompt]:
        """The first ``count`` held-out prompts, the same list on every call."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count and self.heldout_fraction <= 0:
            raise SplitError(
                f"environment {self.name!r} holds no prompts out (heldout_fraction = 0)"
            )
        found: list[Prompt] = []
        index = 0
        while len(found) < count:
            if index >= MAX_DRAWS + 100 * count:
                raise SplitError(
                    f"environment {self.name!r}: {len(found)} held-out prompts in its first "
                    f"{index} prompts, {count} needed; it has too few distinct prompts"
                )
            prompt = self.prompt(index)
            if self.is_heldout(prompt):
                found.append(prompt)
            index += 1
        return found


def _checked_message(message: Message) -> dict[str, str]:
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "user", "assistant") or not isinstance(content, str):
        raise ValueError(
            "a chat message is {'role': 'system' | 'user' | 'assistant', 'content': str}, "
            f"got {dict(message)!r}"
        )
    return {"role": role, "content": content}


def _redraw_index(name: str, index: int, draw: int) -> int:
    """Where training prompt ``index`` looks on its ``draw``-th try: a stable hash, so the
    replacement is the same in every process and lands anywhere in ``[0, 2**31)``."""
    digest = hashlib.sha256(f"plexrl-train:{name}:{index}:{draw}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


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
