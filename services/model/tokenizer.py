"""The character-level tokenizer of the tiny model.

One token per character keeps the toy tasks (reverse a string, add two numbers) free of
tokenization artefacts: a reward that checks characters sees exactly what the policy chose.
The tokenizer is a ``tokenizers`` WordLevel model over single characters, wrapped as a
transformers fast tokenizer so every Hugging Face tool (AutoTokenizer, vLLM) loads it unchanged.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
"""Special tokens take the first ids, in this order: <pad> is 0, <bos> 1, <eos> 2, <unk> 3."""

PUNCTUATION = ".,:;!?+-*/=()[]<>'\"_#@"

CHARACTERS = (
    string.ascii_lowercase + string.ascii_uppercase + string.digits + " " + PUNCTUATION + "\n"
)
"""Every character the tokenizer knows; anything else encodes as <unk>."""


def character_vocab() -> dict[str, int]:
    """Token -> id: the special tokens first, then one id per character of CHARACTERS."""
    tokens = [*SPECIAL_TOKENS, *CHARACTERS]
    if len(set(tokens)) != len(tokens):
        raise AssertionError("duplicate token in the character vocabulary")
    return {token: idx for idx, token in enumerate(tokens)}


def build_char_tokenizer() -> Any:
    """A transformers fast tokenizer with one token per character of CHARACTERS.

    Returned as ``Any`` because transformers renames its tokenizer base class between major
    versions; callers use the common ``PreTrainedTokenizerBase`` interface.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=character_vocab(), unk_token=UNK_TOKEN))
    # An empty pattern matches between every pair of characters, so "isolated" leaves exactly
    # one character per pre-token, including spaces and newlines.
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def save_char_tokenizer(out_dir: Path) -> Any:
    """Write the character tokenizer into ``out_dir`` (``tokenizer.json`` and its config)."""
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(str(out_dir))
    # Recent transformers record their own backend class name, which older releases (and the
    # tools pinned to them, such as some vLLM builds) cannot resolve; the generic fast
    # tokenizer class loads everywhere.
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return tokenizer
