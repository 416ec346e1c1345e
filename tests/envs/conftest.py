"""Fixtures of the environment tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.envs.chat_model import build_chat_tokenizer


@pytest.fixture(scope="session")
def chat_tokenizer() -> Any:
    return build_chat_tokenizer()
