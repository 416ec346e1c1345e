"""Chat models: prompts with messages go through the tokenizer's chat template, and a reply
ends on the template's end-of-turn token."""

from __future__ import annotations

from typing import Any

import pytest

from services.envs import (
    Prompt,
    decode_ids,
    encode_text,
    end_of_turn_ids,
    load_environment,
    prompt_token_ids,
    score_completion,
)
from services.model.tokenizer import build_char_tokenizer, character_vocab
from tests.envs.chat_model import build_chat_tokenizer

MESSAGES = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "add: 3+4="},
]


def test_messages_render_through_the_chat_template(chat_tokenizer: Any) -> None:
    prompt = Prompt.chat(MESSAGES, target="7")
    ids = prompt_token_ids(chat_tokenizer, prompt)
    assert decode_ids(chat_tokenizer, ids, skip_special_tokens=False) == (
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n"
        "<|im_start|>user\nadd: 3+4=<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    im_start = chat_tokenizer.convert_tokens_to_ids("<|im_start|>")
    # the template's markers are single special tokens, and nothing is added in front
    assert ids[0] == im_start
    assert ids.count(im_start) == 3
    assert ids[-len("assistant\n") - 1 :] == [im_start, *encode_text(chat_tokenizer, "assistant\n")]


def test_a_prompt_without_messages_is_its_text_even_for_a_chat_model(chat_tokenizer: Any) -> None:
    prompt = Prompt(text="add: 3+4=", target="7")
    assert prompt_token_ids(chat_tokenizer, prompt) == encode_text(chat_tokenizer, "add: 3+4=")
    assert prompt_token_ids(chat_tokenizer, prompt) == prompt_token_ids(chat_tokenizer, prompt.text)


def test_messages_without_a_template_fall_back_to_the_text() -> None:
    tokenizer = build_char_tokenizer()
    prompt = Prompt.chat(MESSAGES, target="7")
    assert prompt.text == "Answer with a number.\nadd: 3+4="
    vocab = character_vocab()
    assert prompt_token_ids(tokenizer, prompt) == [
        vocab["<bos>"],
        *encode_text(tokenizer, prompt.text),
    ]


def test_end_of_turn_is_the_special_token_after_a_reply(chat_tokenizer: Any) -> None:
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(chat_tokenizer) == [im_end]
    assert end_of_turn_ids(build_char_tokenizer()) == []  # no template, no turns


def test_a_turn_closed_by_plain_text_gives_no_stop_token() -> None:
    # stopping on "\n" would cut every multi-line reply short
    plain = build_chat_tokenizer(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    assert end_of_turn_ids(plain) == []
    # a template that cannot render a plain exchange has no end of turn either
    picky = build_chat_tokenizer("{{ raise_exception('system message first') }}")
    assert end_of_turn_ids(picky) == []


def test_a_reply_that_stopped_on_end_of_turn_scores_its_text(chat_tokenizer: Any) -> None:
    env = load_environment("add", seed=0)
    prompt = Prompt.chat(MESSAGES, target="7")
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (
        score_completion(env, chat_tokenizer, prompt, [*encode_text(chat_tokenizer, "7"), im_end])
        == 1.0
    )
    eight = [*encode_text(chat_tokenizer, "8"), im_end]
    assert score_completion(env, chat_tokenizer, prompt, eight) == pytest.approx(0.3 * 0.9 + 0.2)


def test_chat_prompts_are_checked_and_stay_hashable() -> None:
    prompt = Prompt.chat(MESSAGES, target="7", info={"entry": [1, 2]})
    same = Prompt.chat(list(MESSAGES), target="7", info={"other": 3})
    assert prompt == same and hash(prompt) == hash(same)  # info is the environment's, not identity
    assert prompt != Prompt(text=prompt.text, target="7")
    assert prompt.messages is not None and prompt.messages[1]["content"] == "add: 3+4="
    with pytest.raises(ValueError, match="role"):
        Prompt.chat([{"role": "tool", "content": "x"}], target="")
    with pytest.raises(ValueError, match="empty"):
        Prompt.chat([], target="")
