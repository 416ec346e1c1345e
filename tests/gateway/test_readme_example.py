"""The documented examples run as printed, against a real gateway: the Tinker SDK and OpenAI
examples of the APIs page (docs/apis.md) and the README's "Drive it with the Tinker SDK"."""

from __future__ import annotations

import contextlib
import io
import re
from typing import Any

import pytest
import tinker
from gateway_support import REPO

pytestmark = pytest.mark.timeout(300)


def _examples(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def _run(example: str, url: str) -> list[str]:
    """What ``example`` prints; then its Tinker sessions are closed, as leaving the user's
    program would end them, so its runs give their slots back to the other tests at once."""
    printed, namespace = io.StringIO(), dict[str, Any]()
    try:
        with contextlib.redirect_stdout(printed):
            exec(example.replace("http://127.0.0.1:8000", url), namespace)
    finally:
        for value in namespace.values():
            if isinstance(value, tinker.ServiceClient):
                value.close("success").result()
    return printed.getvalue().splitlines()


def test_the_api_pages_examples_run(stack) -> None:
    page = (REPO / "docs" / "apis.md").read_text(encoding="utf-8")
    tinker_example, openai_example = _examples(page)[:2]
    lines = _run(tinker_example, stack.url) + _run(openai_example, stack.url)
    losses = [float(line.split()[1]) for line in lines[:5]]
    assert [int(line.split()[0]) for line in lines[:5]] == [0, 1, 2, 3, 4]
    assert losses[-1] < losses[0], lines
    assert any(line.startswith("OpenAI model name: run_tk_") for line in lines), lines


def test_the_readmes_example_runs(stack) -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Drive it with the Tinker SDK", 1)[1].split("\n## ", 1)[0]
    (example,) = _examples(section)
    lines = _run(example, stack.url)
    losses = [float(line.split()[1]) for line in lines[:3]]
    assert [int(line.split()[0]) for line in lines[:3]] == [0, 1, 2], lines
    assert losses[-1] < losses[0], lines
    assert lines[3].startswith("[") and lines[3].endswith("]"), lines
