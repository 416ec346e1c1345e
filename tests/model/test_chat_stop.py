"""A chat model's replies end at its template's end-of-turn token: the sampler's stop ids
include it next to the end-of-sequence ids of the model and the tokenizer."""

from __future__ import annotations

from types import SimpleNamespace

from services.model.sampling import eos_token_ids
from services.model.tokenizer import build_char_tokenizer
from tests.envs.chat_model import build_chat_tokenizer


def test_stop_ids_include_the_end_of_turn_token() -> None:
    tokenizer = build_chat_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[eos]), config=None)
    assert im_end != eos
    assert eos_token_ids(model, tokenizer) == sorted([eos, im_end])
    assert eos_token_ids(model) == [eos]  # no tokenizer, no template to read


def test_a_tokenizer_without_a_template_adds_no_stop_id() -> None:
    tokenizer = build_char_tokenizer()
    model = SimpleNamespace(generation_config=None, config=SimpleNamespace(eos_token_id=2))
    assert eos_token_ids(model, tokenizer) == [tokenizer.eos_token_id] == [2]
