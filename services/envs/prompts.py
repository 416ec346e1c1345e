"""The prompt convention every service shares: how a task becomes token ids and back.

A prompt is ``[<bos>] + encode_text(prompt.text)`` (``<bos>`` where the tokenizer has one); a
completion is the answer followed by ``<eos>``, and it is scored as
``env.score(prompt, decode_ids(completion_ids))``: decoded without special tokens, so a
completion that stopped on ``<eos>`` simply ends the text. The orchestrator, the warm start and
the evaluation all go through these functions; the tokenizer is any Hugging Face tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.envs.base import Environment, Prompt


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens: prompts get <bos> only where a caller says."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [int(i) for i in ids]


def decode_ids(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of ``ids``; special tokens are dropped unless asked for."""
    text = tokenizer.decode(
        list(ids),
        skip_special_tokens=skip_special_tokens,
        clean_up_tokenization_spaces=False,
    )
    return str(text)


def prompt_token_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids a model continues for prompt ``text``: ``<bos>`` (if any) + the text."""
    ids = encode_text(tokenizer, text)
    bos = getattr(tokenizer, "bos_token_id", None)
    return [int(bos), *ids] if bos is not None else ids


def score_completion(
    env: Environment, tokenizer: Any, prompt: Prompt, completion_ids: Sequence[int]
) -> float:
    """The reward of one completion of ``prompt``: decoded without special tokens, then scored."""
    return float(env.score(prompt, decode_ids(tokenizer, completion_ids)))
