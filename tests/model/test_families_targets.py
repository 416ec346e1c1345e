"""Default LoRA targets per family, the admission check of targets, and the Conv1D layer."""

from __future__ import annotations

import json

import pytest
import torch

from schemas.config import DEFAULT_TARGET_MODULES
from services.model.families import (
    FAMILIES,
    check_targets,
    default_target_modules,
    tiny_family_config,
    tiny_family_model,
)
from services.model.lora import MultiLoRA, MultiLoRALinear

SUPPORTED = r"plexrl's LoRA wraps nn\.Linear and Conv1D"


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("llama", DEFAULT_TARGET_MODULES),
        ("qwen2", DEFAULT_TARGET_MODULES),
        ("qwen3", DEFAULT_TARGET_MODULES),
        ("mistral", DEFAULT_TARGET_MODULES),
        ("gemma3", DEFAULT_TARGET_MODULES),
        ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
        ("gpt2", ("c_attn", "c_proj", "c_fc")),
        ("qwen3_moe", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ],
)
def test_attach_without_targets_takes_the_familys_defaults(family, expected):
    model = tiny_family_model(family)
    assert default_target_modules(model.config.model_type) == expected
    lora = MultiLoRA.attach(model, n_adapters=2, max_rank=4)
    assert lora.target_modules == expected
    assert {name.rpartition(".")[2] for name in lora.layers} == set(expected)
    # Nothing outside the targets trains: the experts and the router of the MoE stay frozen.
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in lora.slot_named_parameters(0)} | {
        n for n, _ in lora.slot_named_parameters(1)
    }


def test_tiny_llama_targets_are_unchanged(tiny_dir):
    from services.model.loader import load_model

    model, _ = load_model(tiny_dir)
    assert MultiLoRA.attach(model, n_adapters=1, max_rank=4).target_modules == (
        DEFAULT_TARGET_MODULES
    )


def test_unlisted_model_types_fall_back_to_peft_and_unknown_ones_are_refused():
    # bloom is not in plexrl's table; PEFT's names its fused attention projection.
    assert default_target_modules("bloom") == ("query_key_value",)
    with pytest.raises(ValueError, match="no default LoRA target_modules for model_type 'zebra'"):
        default_target_modules("zebra")


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (
            ["q_proj", "gate_up_proj"],
            r"model\.layers\.0\.mlp\.experts\.gate_up_proj is a parameter of shape \[4, 128, 64\] "
            r"inside a <class '.*Qwen3MoeExperts'>, not a layer; " + SUPPORTED,
        ),
        (["experts"], r"model\.layers\.0\.mlp\.experts is a <class '.*Qwen3MoeExperts'>; "),
        (["mlp"], r"model\.layers\.0\.mlp is a <class '.*Qwen3MoeSparseMoeBlock'>; " + SUPPORTED),
        (["c_attn"], r"no nn\.Linear or Conv1D module .* matches target_modules \['c_attn'\]"),
        ([], "target_modules must be a non-empty list of names"),
    ],
)
def test_unsupported_targets_are_named(targets, message):
    config = tiny_family_config("qwen3_moe")
    with pytest.raises(ValueError, match=message):
        check_targets(config, targets)
    # attach refuses the same targets before it changes the model.
    model = tiny_family_model("qwen3_moe")
    with pytest.raises(ValueError, match=message):
        MultiLoRA.attach(model, n_adapters=1, max_rank=4, target_modules=targets)
    assert not any(isinstance(m, MultiLoRALinear) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())


def test_check_targets_reads_a_directory_a_dict_or_a_config(tmp_path):
    config = tiny_family_config("phi3")
    config.save_pretrained(tmp_path)
    as_dict = json.loads((tmp_path / "config.json").read_text())
    expected = [
        f"model.layers.{i}.{name}"
        for i in range(2)
        for name in ("self_attn.o_proj", "self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]
    assert check_targets(tmp_path) == expected
    assert check_targets(str(tmp_path / "config.json")) == expected
    assert check_targets(as_dict) == expected
    assert check_targets(config) == expected
    assert check_targets(config, ["qkv_proj"]) == expected[1::4]


def test_check_targets_builds_on_the_meta_device():
    # A 70B-shaped Llama would need 280 GB in float32; on the meta device it needs nothing.
    config = {
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    }
    names = check_targets(config)
    assert len(names) == 80 * 7
    assert names[-1] == "model.layers.79.mlp.down_proj"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", r"no model config at .*missing: expected a directory"),
        (lambda p: p, r"no model config at .*: expected a directory with config\.json"),
        (lambda p: _write(p / "config.json", "{not json"), r"config\.json is not JSON"),
        (lambda p: {"hidden_size": 64}, "the model config has no model_type"),
        (lambda p: {"model_type": "zebra"}, "transformers cannot read this 'zebra' config"),
        (lambda p: 42, "a model config is a directory, a config.json dict"),
    ],
)
def test_check_targets_rejects_bad_configs_clearly(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        check_targets(make(tmp_path), ["q_proj"])


def _write(path, text):
    path.write_text(text)
    return path


def test_conv1d_slot_is_x_a_b_in_the_right_orientation():
    from transformers.pytorch_utils import Conv1D

    gen = torch.Generator().manual_seed(0)
    conv = Conv1D(nf=12, nx=5)  # weight [in 5, out 12]
    with torch.no_grad():
        conv.weight.copy_(torch.randn(5, 12, generator=gen))
        conv.bias.copy_(torch.randn(12, generator=gen))
    layer = MultiLoRALinear(conv, n_adapters=2, max_rank=4)
    assert (layer.in_features, layer.out_features, layer.fan_in_fan_out) == (5, 12, True)
    a, b = torch.randn(3, 5, generator=gen), torch.randn(12, 3, generator=gen)
    layer.load_slot(1, a, b)
    layer.adapter_context.configure_slot(1, 3, 6.0)
    x = torch.randn(2, 7, 5, generator=gen)
    layer.adapter_context.set_slot_ids([1, -1])
    with torch.no_grad():
        y = layer(x)
    w, bias = conv.weight.detach(), conv.bias.detach()
    torch.testing.assert_close(y[0], x[0] @ w + bias + 2.0 * (x[0] @ a.T @ b.T))
    assert torch.equal(y[1], conv(x[1]))


def test_multi_lora_linear_refuses_other_layers():
    with pytest.raises(
        TypeError, match=r"wraps nn\.Linear and Conv1D .* got <class '.*Embedding'>"
    ):
        MultiLoRALinear(torch.nn.Embedding(10, 4), n_adapters=1, max_rank=2)


def test_every_family_builds_reproducibly():
    for family in FAMILIES:
        one, two = tiny_family_model(family, seed=3), tiny_family_model(family, seed=3)
        for (name, p), (_, q) in zip(
            one.state_dict().items(), two.state_dict().items(), strict=True
        ):
            assert torch.equal(p, q), f"{family}: {name} differs between two builds"
    with pytest.raises(ValueError, match="unknown model family 'bert'"):
        tiny_family_model("bert")
