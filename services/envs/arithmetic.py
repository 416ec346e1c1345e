"""``add``: sums of two numbers, ``add: 3+4=`` -> ``7``.

Reward, with ``d`` the digits the answer starts with (value ``v``), ``t`` the target (value
``n``), ``a`` the whole answer (up to the first newline) and ``s = max_operand + 1``::

    score = 0                                          if d is empty
    score = (0.5 * [d == t]
             + 0.3 * max(0, 1 - |v - n| / s)
             + 0.2 * [len(d) == len(t)]) * len(d) / len(a)

An exact answer earns 1; ``8`` for ``7`` earns 0.47 (close, right digit count); ``7`` followed
by two stray characters earns 1/3. Closeness gives a gradient towards the right sum before the
model gets it exactly, and the ``len(d) / len(a)`` factor makes trailing garbage cost. A random
model rarely starts with a digit and never stops early, so it scores close to 0.
"""

from __future__ import annotations

from services.envs.base import Environment, Prompt, answer_of


class AddEnv(Environment):
    """``add: a+b=`` -> ``a + b`` for ``a, b`` in ``0..max_operand`` (single digits by default)."""

    name = "add"

    def __init__(self, seed: int = 0, *, max_operand: int = 9) -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        super().__init__(seed)
        self.max_operand = max_operand

    def prompt(self, index: int) -> Prompt:
        rng = self.rng(index)
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return Prompt(text=f"add: {a}+{b}=", target=str(a + b))

    def score(self, prompt: Prompt, completion_text: str) -> float:
        answer = answer_of(completion_text)
        digits = _leading_digits(answer)
        if not digits:
            return 0.0
        target = prompt.target
        closeness = max(0.0, 1.0 - abs(int(digits) - int(target)) / (self.max_operand + 1))
        core = 0.5 * (digits == target) + 0.3 * closeness + 0.2 * (len(digits) == len(target))
        return core * len(digits) / len(answer)


def _leading_digits(text: str) -> str:
    end = 0
    while end < len(text) and text[end] in "0123456789":
        end += 1
    return text[:end]
