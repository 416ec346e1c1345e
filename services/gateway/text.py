"""Text <-> token ids for the OpenAI API, with the base model's own tokenizer.

Prompts follow plexrl's one convention (:mod:`services.envs.prompts`): ``<bos>`` where the
tokenizer has one, then the text, so a prompt sent as text reaches the model exactly as an
orchestrator's prompt does. Chat messages go through the tokenizer's chat template when it has
one; without one they are laid out as ``role: content`` lines ending in ``assistant:``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.envs.prompts import decode_ids, encode_text, prompt_token_ids


class TextCodec:
    """The tokenizer of the base model, as the APIs use it."""

    def __init__(self, tokenizer: Any, context_len: int = 1 << 20, arch: str = "") -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.context_len = context_len
        """the most tokens a sequence may hold (the model's max_position_embeddings)"""
        self.arch = arch
        """the model's architecture (its config's first ``architectures`` entry)"""

    @classmethod
    def load(cls, model_dir: Path) -> TextCodec:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        context = int(config.get("max_position_embeddings") or 1 << 20)
        arch = (config.get("architectures") or [config.get("model_type") or ""])[0]
        return cls(tokenizer, context, str(arch))

    @property
    def bos_id(self) -> int:
        """The start-of-text token (or 0 when the tokenizer has none)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return int(bos) if bos is not None else 0

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, text: str) -> list[int]:
        return prompt_token_ids(self.tokenizer, text)

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt of a chat: the template's rendering with the assistant's turn opened."""
        if self.has_chat_template:
            ids = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict):  # newer transformers return a BatchEncoding
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return self.prompt_ids("\n".join([*lines, "assistant:"]))

    def text(self, ids: Sequence[int]) -> str:
        return decode_ids(self.tokenizer, ids)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (special tokens spelled out), for logprobs."""
        return [decode_ids(self.tokenizer, [i], skip_special_tokens=False) for i in ids]

    def check_ids(self, ids: Sequence[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})"
            )

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)
