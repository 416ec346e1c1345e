"""The README's "Tinker and OpenAI APIs" examples run as printed, against a real gateway."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from gateway_support import REPO

pytestmark = pytest.mark.timeout(300)


def _examples() -> list[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Tinker and OpenAI APIs", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_the_readme_examples_run(stack) -> None:
    tinker_example, openai_example = _examples()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(tinker_example.replace("http://127.0.0.1:8000", stack.url), {})
        exec(openai_example.replace("http://127.0.0.1:8000", stack.url), {})
    lines = printed.getvalue().splitlines()
    losses = [float(line.split()[1]) for line in lines[:5]]
    assert [int(line.split()[0]) for line in lines[:5]] == [0, 1, 2, 3, 4]
    assert losses[-1] < losses[0], lines
    assert any(line.startswith("OpenAI model name: run_tk_") for line in lines), lines
