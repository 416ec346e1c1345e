"""The default tiny model: a small Llama with the character tokenizer.

It is big enough to learn the toy tasks in a few hundred RL steps on a CPU and small enough that
the whole test suite can build it on the fly. The architecture is a stock ``LlamaForCausalLM``,
so the same code paths (PEFT, vLLM, the multi-LoRA layer) serve it and any real checkpoint.

Weights come from a fixed seed in a forked RNG: two builds with the same seed are bit-identical
and building never disturbs the caller's random state. Nothing touches the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.model.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, character_vocab


@dataclass(frozen=True, kw_only=True)
class TinySpec:
    """Shape of the tiny model; the defaults are the model ``plexrl model tiny`` writes."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 192
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True


@dataclass(frozen=True, kw_only=True)
class TinySummary:
    """What was written: enough for a one-line report."""

    path: Path
    num_parameters: int
    vocab_size: int


def tiny_config(spec: TinySpec | None = None) -> Any:
    """The ``LlamaConfig`` of the tiny model, with the character vocabulary's special ids."""
    from transformers import LlamaConfig

    spec = spec or TinySpec()
    vocab = character_vocab()
    return LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=vocab[PAD_TOKEN],
        bos_token_id=vocab[BOS_TOKEN],
        eos_token_id=vocab[EOS_TOKEN],
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
    )


def build_tiny(out_dir: Path, seed: int = 0, spec: TinySpec | None = None) -> TinySummary:
    """Write the tiny model and its tokenizer into ``out_dir`` and say what was written."""
    import torch
    from transformers import LlamaForCausalLM

    from services.model.loader import quiet_progress_bars
    from services.model.tokenizer import save_char_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = LlamaForCausalLM(config)
    model.to(torch.float32)
    model.eval()
    with quiet_progress_bars():
        model.save_pretrained(str(out_dir), safe_serialization=True)
    save_char_tokenizer(out_dir)
    return TinySummary(
        path=out_dir,
        num_parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=config.vocab_size,
    )


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Write the default tiny model into ``out_dir``; returns the directory."""
    return build_tiny(out_dir, seed=seed).path
