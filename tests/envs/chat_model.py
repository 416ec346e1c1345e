"""A chat model's tokenizer, made in-process: one token per character, ChatML's turn markers
as special tokens and a ChatML chat template (the layout Qwen's tokenizers use)."""

from __future__ import annotations

import string
from typing import Any

CHAT_SPECIALS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_tokenizer(template: str | None = CHATML) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = dict.fromkeys(string.printable.replace("\r", "").replace("\x0b", ""))
    vocab = {token: i for i, token in enumerate([*CHAT_SPECIALS, *characters])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(CHAT_SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<|endoftext|>",
        chat_template=template,
        clean_up_tokenization_spaces=False,
    )
