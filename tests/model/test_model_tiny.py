"""The tiny model is reproducible, loads like any Hugging Face model and tokenizes by character."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.cli import main
from services.envs import decode_ids, encode_text
from services.model.loader import ModelDirectoryError, load_model
from services.model.tiny import build_tiny_model
from services.model.tokenizer import CHARACTERS, character_vocab

REPO = Path(__file__).resolve().parents[2]


def test_two_builds_are_bit_identical_and_the_seed_matters(tiny_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    weights = (tiny_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (again / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != weights


def test_build_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "model")
    assert torch.equal(torch.rand(3), expected)


def test_load_model_round_trip(tiny_dir):
    model, tokenizer = load_model(tiny_dir)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (64, 2, 192)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings == 256 and config.vocab_size == 90
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training
    saved = load_file(str(tiny_dir / "model.safetensors"))
    state = model.state_dict()
    assert set(saved) <= set(state)
    assert all(torch.equal(state[k], v) and v.dtype == torch.float32 for k, v in saved.items())
    assert len(tokenizer) == 90
    specials = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert specials == (0, 1, 2) and tokenizer.unk_token_id == 3
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == specials


def test_tokenizer_is_one_token_per_character(tiny_dir):
    _, tokenizer = load_model(tiny_dir)
    vocab = character_vocab()
    text = "reverse: abc="
    ids = encode_text(tokenizer, text)
    assert ids == [vocab[c] for c in text]
    assert decode_ids(tokenizer, ids) == text
    every = CHARACTERS
    assert decode_ids(tokenizer, encode_text(tokenizer, every)) == every
    assert len(encode_text(tokenizer, every)) == len(every) == 86
    assert encode_text(tokenizer, "a~") == [vocab["a"], vocab["<unk>"]]
    eos = tokenizer.eos_token_id
    assert decode_ids(tokenizer, [*ids, eos]) == text
    assert decode_ids(tokenizer, [*ids, eos], skip_special_tokens=False) == text + "<eos>"


def test_load_model_explains_a_directory_without_config(tmp_path):
    with pytest.raises(ModelDirectoryError, match=r"not a Hugging Face model directory.*plexrl"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"`plexrl model tiny "):
        load_model(tmp_path / "absent")


def test_cli_writes_the_model_and_prints_a_summary(tiny_dir, tmp_path, capsys):
    assert main(["model", "tiny", str(tmp_path / "cli"), "--seed", "0", "--no-pretrain"]) == 0
    line = capsys.readouterr().out.strip()
    model, _ = load_model(tmp_path / "cli")
    count = sum(p.numel() for p in model.parameters())
    assert line == (
        f"wrote tiny Llama to {tmp_path / 'cli'}: {count:,} parameters, vocab 90, seed 0"
    )
    expected = (tiny_dir / "model.safetensors").read_bytes()
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == expected


def test_cli_module_imports_no_torch():
    code = "import sys, services.model.cli; sys.exit(int('torch' in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()
