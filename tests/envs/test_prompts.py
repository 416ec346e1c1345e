"""The shared prompt convention, and a library the registry can import without torch."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from services.envs import (
    Prompt,
    decode_ids,
    encode_text,
    load_environment,
    prompt_token_ids,
    score_completion,
)
from services.model.tokenizer import build_char_tokenizer, character_vocab

VOCAB = character_vocab()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_char_tokenizer()


def test_prompt_ids_start_with_bos(tokenizer: Any) -> None:
    ids = prompt_token_ids(tokenizer, "ab=")
    assert ids == [VOCAB["<bos>"], VOCAB["a"], VOCAB["b"], VOCAB["="]]
    assert encode_text(tokenizer, "ab=") == ids[1:]


def test_prompt_without_bos_is_the_text() -> None:
    class NoBos:
        bos_token_id = None

        def encode(self, text: str, add_special_tokens: bool) -> list[int]:
            assert not add_special_tokens
            return [ord(c) for c in text]

    assert prompt_token_ids(NoBos(), "hi") == [ord("h"), ord("i")]


def test_completions_are_scored_without_special_tokens(tokenizer: Any) -> None:
    env = load_environment("reverse", seed=0)
    prompt = Prompt(text="reverse: abc=", target="cba")
    ids = [*encode_text(tokenizer, "cba"), VOCAB["<eos>"]]
    assert decode_ids(tokenizer, ids) == "cba"
    assert decode_ids(tokenizer, ids, skip_special_tokens=False) == "cba<eos>"
    assert score_completion(env, tokenizer, prompt, ids) == 1.0
    assert score_completion(env, tokenizer, prompt, ids[:2]) == pytest.approx(
        1 / 3
    )  # a near miss: half its accuracy


def test_importing_the_library_pulls_in_neither_torch_nor_a_service() -> None:
    code = (
        "import sys, services.envs; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith("
        "('services.registry', 'services.trainer', 'services.inference', "
        "'services.orchestrator', 'services.model'))); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
