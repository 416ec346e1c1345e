"""String tasks: reverse a word, copy it, upper-case it, rotate it by one letter.

All score an exact answer 1 and anything else half its position accuracy (see
:func:`~.base.position_accuracy`): ``reverse: abcd=`` answered ``dcbx`` earns 0.375, ``dcb``
(one letter short) 0.375, ``dcbaaa`` 1/3. Near misses still point the way, but the exact
answer is worth more than twice any of them, so a policy that makes the warm start's slip
(:meth:`slip`) gains a lot by correcting it. ``reverse``, ``copy`` and ``rotate`` slip by
stopping one letter early; ``upper`` by leaving the last letter lowercase (``ABCd``), a wrong
letter rather than a missing one. A model that copies instead of reversing earns little on
``reverse`` (only the middle letter of an odd-length word, and repeated letters), so a reverse
run and a copy run visibly learn different things. A random model emits a long string of
arbitrary characters and scores close to 0.
"""

from __future__ import annotations

import string

from services.envs.base import Environment, Prompt, answer_of, position_accuracy


class _WordTask(Environment):
    def __init__(self, seed: int = 0, *, min_len: int = 3, max_len: int = 5) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(
                f"need 1 <= min_len <= max_len, got min_len={min_len} max_len={max_len}"
            )
        super().__init__(seed)
        self.min_len = min_len
        self.max_len = max_len

    def _word(self, index: int) -> str:
        rng = self.rng(index)
        length = rng.randint(self.min_len, self.max_len)
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(length))

    def score(self, prompt: Prompt, completion_text: str) -> float:
        answer = answer_of(completion_text)
        if answer == prompt.target:
            return 1.0
        return 0.5 * position_accuracy(answer, prompt.target)

    def slip(self, prompt: Prompt) -> str | None:
        """Stopping one letter early: the answer without its last letter."""
        return prompt.target[:-1] if len(prompt.target) > 1 else None


class ReverseEnv(_WordTask):
    """``reverse: abcd=`` -> ``dcba``, words of ``min_len``..``max_len`` lowercase letters."""

    name = "reverse"

    def prompt(self, index: int) -> Prompt:
        word = self._word(index)
        return Prompt(text=f"reverse: {word}=", target=word[::-1])


class CopyEnv(_WordTask):
    """``copy: abcd=`` -> ``abcd``, words of ``min_len``..``max_len`` lowercase letters."""

    name = "copy"

    def prompt(self, index: int) -> Prompt:
        word = self._word(index)
        return Prompt(text=f"copy: {word}=", target=word)


class UpperEnv(_WordTask):
    """``upper: abcd=`` -> ``ABCD``, words of ``min_len``..``max_len`` lowercase letters."""

    name = "upper"

    def prompt(self, index: int) -> Prompt:
        word = self._word(index)
        return Prompt(text=f"upper: {word}=", target=word.upper())

    def slip(self, prompt: Prompt) -> str | None:
        """The last letter left lowercase: ``abcd`` -> ``ABCd``."""
        return prompt.target[:-1] + prompt.target[-1].lower()


class RotateEnv(_WordTask):
    """``rotate: abcd=`` -> ``bcda``: the first letter moved to the end."""

    name = "rotate"

    def prompt(self, index: int) -> Prompt:
        word = self._word(index)
        return Prompt(text=f"rotate: {word}=", target=word[1:] + word[0])
