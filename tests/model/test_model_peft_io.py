"""Adapters leave the trainer in formats PEFT loads as they are, and come back unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from services.model.lora import peft_key
from services.model.peft_io import (
    AdapterFormatError,
    adapter_from_bytes,
    adapter_to_bytes,
    read_peft_dir,
    write_peft_dir,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

IDS = torch.tensor([[5, 17, 33, 4, 60, 71, 12, 9], [88, 3, 41, 41, 2, 19, 27, 66]])


def test_slot_state_dict_uses_peft_keys_trimmed_to_rank(multi_lora, peft_reference, randomize):
    from peft import get_peft_model_state_dict

    _, lora = multi_lora(n_adapters=2, max_rank=8)
    randomize(lora, 1, 3, 6.0, seed=5)
    state = lora.slot_state_dict(1)
    reference = peft_reference(state, rank=3, alpha=6.0)
    assert set(state) == set(get_peft_model_state_dict(reference))
    name = "model.layers.0.mlp.down_proj"
    assert state[peft_key(name, "lora_A")].shape == (3, 192)
    assert state[peft_key(name, "lora_B")].shape == (64, 3)
    assert all(t.device.type == "cpu" and not t.requires_grad for t in state.values())
    # A copy, not a view: changing the export leaves the slot alone.
    state[peft_key(name, "lora_B")].fill_(1.0)
    assert not torch.equal(lora.layers[name].lora_B[1][:, :3], torch.ones(64, 3))


def test_bytes_round_trip_and_digest(multi_lora, randomize):
    _, lora = multi_lora(n_adapters=1, max_rank=4)
    randomize(lora, 0, 4, 8.0, seed=1)
    state = lora.slot_state_dict(0)
    data = adapter_to_bytes(state)
    back = adapter_from_bytes(data)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert adapter_to_bytes(back) == data


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda data: b"definitely not safetensors",
        lambda data: b"",
        lambda data: data[: len(data) // 2],
        lambda data: b"\xff" * 8 + data[8:],
        lambda data: data[:8] + b"[" + data[9:],
    ],
    ids=["garbage", "empty", "truncated", "huge-header", "broken-header"],
)
def test_corrupted_bytes_raise_adapter_format_error(corrupt):
    data = adapter_to_bytes({"base_model.model.x.lora_A.weight": torch.ones(2, 4)})
    with pytest.raises(AdapterFormatError, match="not a safetensors adapter"):
        adapter_from_bytes(corrupt(data))


def test_peft_dir_loads_in_peft_with_the_same_logits(multi_lora, randomize, tiny_dir, tmp_path):
    from peft import PeftModel

    from services.model.loader import load_model

    model, lora = multi_lora(n_adapters=3, max_rank=8)
    randomize(lora, 2, 4, 12.0, seed=9)
    target = tmp_path / "broadcast" / "step_1"
    write_peft_dir(
        target, lora.slot_state_dict(2), 4, 12.0, lora.target_modules, base_model_path="tiny"
    )
    assert sorted(p.name for p in target.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((target / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"]) == ("LORA", "CAUSAL_LM", 4)
    assert config["lora_alpha"] == 12.0 and config["bias"] == "none"

    base, _ = load_model(tiny_dir)
    reference = PeftModel.from_pretrained(base, str(target))
    with torch.no_grad():
        expected = reference(input_ids=IDS).logits
        with lora.use([2, 2]):
            got = model(input_ids=IDS).logits
        with lora.use(None):
            plain = model(input_ids=IDS).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain, expected, atol=1e-3)

    state, rank, alpha, targets = read_peft_dir(target)
    assert (rank, alpha, sorted(targets)) == (4, 12.0, sorted(lora.target_modules))
    exported = lora.slot_state_dict(2)
    assert all(torch.equal(state[k], exported[k]) for k in exported)


def test_write_peft_dir_replaces_an_existing_adapter(tmp_path):
    key = "base_model.model.layer.lora_A.weight"
    target = tmp_path / "adapter"
    write_peft_dir(target, {key: torch.zeros(2, 4)}, 2, 4.0, ["q_proj"])
    write_peft_dir(target, {key: torch.ones(1, 4)}, 1, 2.0, ["q_proj"])
    state, rank, alpha, _ = read_peft_dir(target)
    assert (rank, alpha) == (1, 2.0)
    assert torch.equal(state[key], torch.ones(1, 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_read_peft_dir_names_what_is_missing(tmp_path):
    with pytest.raises(AdapterFormatError, match=r"adapter_config\.json is missing"):
        read_peft_dir(tmp_path)


def test_load_slot_state_dict_round_trip_and_errors(multi_lora, randomize):
    model, lora = multi_lora(n_adapters=2, max_rank=8)
    randomize(lora, 0, 5, 10.0, seed=4)
    state = lora.slot_state_dict(0)
    lora.load_slot_state_dict(1, state, rank=5, alpha=10.0)
    assert (lora.slot_rank(1), lora.context.alpha(1)) == (5, 10.0)
    with torch.no_grad():
        with lora.use([0, 0]):
            first = model(input_ids=IDS).logits
        with lora.use([1, 1]):
            second = model(input_ids=IDS).logits
    assert torch.equal(first, second)

    key = peft_key("model.layers.1.self_attn.k_proj", "lora_B")
    wrong = dict(state, **{key: torch.zeros(32, 4)})
    before = [p.detach().clone() for p in lora.slot_parameters(1)]
    with pytest.raises(ValueError, match=r"k_proj\.lora_B\.weight has shape \[32, 4\]"):
        lora.load_slot_state_dict(1, wrong, rank=5, alpha=10.0)
    # Nothing changes when the adapter is rejected.
    assert all(torch.equal(p, q) for p, q in zip(before, lora.slot_parameters(1), strict=True))
    assert lora.slot_rank(1) == 5

    missing = {k: v for k, v in state.items() if k != key}
    with pytest.raises(ValueError, match=r"missing keys .*k_proj\.lora_B\.weight"):
        lora.load_slot_state_dict(1, missing, rank=5, alpha=10.0)
    extra = dict(state, **{"base_model.model.lm_head.lora_A.weight": torch.zeros(5, 64)})
    with pytest.raises(ValueError, match=r"unexpected keys .*lm_head"):
        lora.load_slot_state_dict(1, extra, rank=5, alpha=10.0)
