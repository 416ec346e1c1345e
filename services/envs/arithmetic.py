"""``add``: sums of a two-digit and a one-digit number, ``add: 47+8=`` -> ``55``.

Operands are ``a`` in ``0..max_first`` and ``b`` in ``0..max_second`` (by default 99 and 9:
1,000 distinct prompts, 45% of them with a carry); ``max_operand`` sets both bounds at once
(``max_operand = 9``: single-digit sums, 100 prompts).

Reward, with ``d`` the digits the answer starts with (value ``v``), ``t`` the target (value
``n``) and ``a`` the whole answer (up to the first newline)::

    score = 0                                          if d is empty
    score = (0.5 * [d == t]
             + 0.3 * max(0, 1 - |v - n| / 10)
             + 0.2 * [len(d) == len(t)]) * len(d) / len(a)

An exact answer earns 1; ``56`` for ``55`` earns 0.47 (close, right digit count); ``45`` (the
carry forgotten, the warm start's slip) earns 0.2; ``55`` followed by two stray characters
earns 1/2. Closeness gives a gradient towards the right sum before the model gets it exactly,
and the ``len(d) / len(a)`` factor makes trailing garbage cost. A random model rarely starts
with a digit and never stops early, so it scores close to 0.
"""

from __future__ import annotations

from services.envs.base import Environment, Prompt, answer_of


class AddEnv(Environment):
    """``add: a+b=`` -> ``a + b`` for ``a`` in ``0..max_first``, ``b`` in ``0..max_second``."""

    name = "add"

    def __init__(
        self,
        seed: int = 0,
        *,
        max_first: int = 99,
        max_second: int = 9,
        max_operand: int | None = None,
    ) -> None:
        if max_operand is not None:
            max_first = max_second = max_operand
        if max_first < 1 or max_second < 1:
            raise ValueError(
                f"operand bounds must be >= 1, got max_first={max_first} max_second={max_second}"
            )
        super().__init__(seed)
        self.max_first = max_first
        self.max_second = max_second

    def prompt(self, index: int) -> Prompt:
        rng = self.rng(index)
        a, b = rng.randint(0, self.max_first), rng.randint(0, self.max_second)
        return Prompt(text=f"add: {a}+{b}=", target=str(a + b))

    def score(self, prompt: Prompt, completion_text: str) -> float:
        answer = answer_of(completion_text)
        digits = _leading_digits(answer)
        if not digits:
            return 0.0
        target = prompt.target
        closeness = max(0.0, 1.0 - abs(int(digits) - int(target)) / 10)
        core = 0.5 * (digits == target) + 0.3 * closeness + 0.2 * (len(digits) == len(target))
        return core * len(digits) / len(answer)

    def slip(self, prompt: Prompt) -> str | None:
        """The carry forgotten: each column's digits summed modulo 10 (``47+8`` -> ``45``)."""
        a, b = prompt.text.removeprefix("add: ").removesuffix("=").split("+")
        width = max(len(a), len(b))
        columns = zip(a.zfill(width), b.zfill(width), strict=True)
        return str(int("".join(str((int(x) + int(y)) % 10) for x, y in columns)))


def _leading_digits(text: str) -> str:
    end = 0
    while end < len(text) and text[end] in "0123456789":
        end += 1
    return text[:end]
