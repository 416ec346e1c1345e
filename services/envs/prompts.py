"""The prompt convention every service shares: how a task becomes token ids and back.

A prompt is ``[<bos>] + encode_text(prompt.text)`` (``<bos>`` where the tokenizer has one). When
the environment gives chat ``messages`` and the tokenizer has a chat template, the prompt is
instead the template's rendering of the messages with the assistant's turn opened
(``add_generation_prompt``), encoded without adding special tokens: the template writes its
own ``<bos>`` where the model wants one. A completion is the answer followed by ``<eos>`` (or,
for a chat model, the template's end-of-turn token: :func:`end_of_turn_ids`), and it is scored
as ``env.score(prompt, decode_ids(completion_ids))``: decoded without special tokens, so a
completion that stopped on either simply ends the text. The orchestrator, the warm start and
the evaluation all go through these functions; the tokenizer is any Hugging Face tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.envs.base import Environment, Message, Prompt

_PROBE = "plexrl probe reply 7"
"""An assistant reply rendered to find what the template writes after a reply."""


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


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template (a chat model's tokenizer does)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: Sequence[Message]) -> str:
    """``messages`` through the tokenizer's chat template, the assistant's turn opened."""
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
    )
    return str(text)


def prompt_token_ids(tokenizer: Any, prompt: Prompt | str) -> list[int]:
    """The token ids a model continues for ``prompt``: its chat rendering when it has messages
    and the tokenizer a template, else ``<bos>`` (if any) + the text."""
    if isinstance(prompt, Prompt):
        if prompt.messages is not None and has_chat_template(tokenizer):
            return encode_text(tokenizer, render_chat(tokenizer, prompt.messages))
        prompt = prompt.text
    ids = encode_text(tokenizer, prompt)
    bos = getattr(tokenizer, "bos_token_id", None)
    return [int(bos), *ids] if bos is not None else ids


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special token the chat template closes an assistant turn with, as a list (empty
    without a template, or when what follows a reply is not one special token).

    Found by rendering a short exchange and reading the first token after the reply:
    ``<|im_end|>`` for ChatML (Qwen), ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for Gemma,
    ``<|end|>`` for Phi-3, ``</s>`` for Mistral. Only a special token counts, so a template
    that ends a turn with plain text (a newline, say) never truncates replies that contain it.
    """
    if not has_chat_template(tokenizer):
        return []
    from jinja2 import TemplateError  # what chat templates are written in

    exchange = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = str(tokenizer.apply_chat_template(exchange, tokenize=False))
    except TemplateError:
        return []  # a template that cannot render a plain exchange has no turn to close
    _, found, after = text.rpartition(_PROBE)
    if not found or not after:
        return []
    first = encode_text(tokenizer, after)[:1]
    return first if first and first[0] in _special_ids(tokenizer) else []


def _special_ids(tokenizer: Any) -> set[int]:
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, token in added.items() if getattr(token, "special", False))
    return ids


def score_completion(
    env: Environment, tokenizer: Any, prompt: Prompt, completion_ids: Sequence[int]
) -> float:
    """The reward of one completion of ``prompt``: decoded without special tokens, then scored."""
    return float(env.score(prompt, decode_ids(tokenizer, completion_ids)))
