"""Every supported model family: multi-slot LoRA equals PEFT, and the published adapter loads in
PEFT as it is, under the module names vLLM reads."""

from __future__ import annotations

import copy
import json
import warnings
from typing import Any

import pytest
import torch

from services.model.families import FAMILIES, tiny_family_model
from services.model.lora import MultiLoRA, peft_key
from services.model.peft_io import ADAPTER_CONFIG, write_peft_dir

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

# slot -> (rank, alpha); max_rank 8; slot 3 stays unused.
SLOTS = {0: (8, 16.0), 1: (4, 4.0), 2: (2, 7.5)}
BATCH_SLOTS = [0, 2, -1, 1, 0, 2]
SEQ_LEN = 12  # longer than the 8-token sliding window of the Mistral and Gemma 3 models
VOCAB = 96

# Layer 0's LoRA-wrapped modules per family, as named_modules() names them: vLLM looks an
# adapter's tensors up as base_model.model.<this path>.lora_A.weight / .lora_B.weight.
LAYER_0 = {
    "llama": [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
    ],
    "phi3": [
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.mlp.down_proj",
    ],
    "gpt2": [
        "transformer.h.0.attn.c_attn",
        "transformer.h.0.attn.c_proj",
        "transformer.h.0.mlp.c_fc",
        "transformer.h.0.mlp.c_proj",
    ],
    "qwen3_moe": [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.0.self_attn.o_proj",
    ],
}
for _same in ("qwen2", "qwen3", "mistral", "gemma3"):
    LAYER_0[_same] = LAYER_0["llama"]


def _multi(family: str, randomize: Any) -> tuple[Any, Any, MultiLoRA]:
    """``(pristine base, multi-LoRA model, its MultiLoRA)`` with the SLOTS randomised."""
    base = tiny_family_model(family, seed=0)
    model = copy.deepcopy(base)
    lora = MultiLoRA.attach(model, n_adapters=4, max_rank=8)
    for idx, (rank, alpha) in SLOTS.items():
        randomize(lora, idx, rank, alpha, seed=idx)
    return base, model, lora


def _peft(base: Any, lora: MultiLoRA, idx: int) -> Any:
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    rank, alpha = lora.slot_rank(idx), lora.context.alpha(idx)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]
        target_modules=list(lora.target_modules),
        fan_in_fan_out=lora.fan_in_fan_out,
        lora_dropout=0.0,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(copy.deepcopy(base), config)
    result: Any = set_peft_model_state_dict(model, lora.slot_state_dict(idx))
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]
    return model


def _ids(batch: int = len(BATCH_SLOTS)) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mixed_batch_matches_single_adapter_peft(family, randomize):
    base, model, lora = _multi(family, randomize)
    ids = _ids()
    weights = torch.randn(*ids.shape, VOCAB, generator=torch.Generator().manual_seed(7))
    num_tokens = ids.numel()
    with lora.use(BATCH_SLOTS):
        logits = model(input_ids=ids).logits
    ((logits * weights).sum() / num_tokens).backward()

    with torch.no_grad():
        bare = base(input_ids=ids).logits
    assert torch.equal(logits[2], bare[2])  # the row of slot -1 is the base model, bit for bit
    for idx, (rank, _) in SLOTS.items():
        rows = [b for b, s in enumerate(BATCH_SLOTS) if s == idx]
        reference = _peft(base, lora, idx)
        ref_logits = reference(input_ids=ids[rows]).logits
        torch.testing.assert_close(logits[rows], ref_logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(ref_logits, bare[rows], atol=1e-3)  # the adapter does act
        ((ref_logits * weights[rows]).sum() / num_tokens).backward()
        ref_grads = {
            name.replace(".default", ""): p.grad
            for name, p in reference.named_parameters()
            if "lora_" in name and p.grad is not None
        }
        assert len(ref_grads) == 2 * len(lora.layers)
        for name, layer in lora.layers.items():
            grad_a, grad_b = layer.lora_A[idx].grad, layer.lora_B[idx].grad
            assert grad_a is not None and grad_b is not None
            ref_a, ref_b = ref_grads[peft_key(name, "lora_A")], ref_grads[peft_key(name, "lora_B")]
            torch.testing.assert_close(grad_a[:rank], ref_a, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(grad_b[:, :rank], ref_b, atol=1e-5, rtol=1e-5)
            assert grad_b[:, :rank].abs().max() > 1e-5
            assert torch.count_nonzero(grad_a[rank:]) == 0
    assert all(p.grad is None for p in lora.slot_parameters(3))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_published_adapter_loads_in_peft_as_it_is(family, randomize, tmp_path):
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    base, model, lora = _multi(family, randomize)
    idx = 1
    config = lora.adapter_config(idx)
    write_peft_dir(
        tmp_path / "adapter",
        lora.slot_state_dict(idx),
        config["r"],  # type: ignore[arg-type]
        config["lora_alpha"],  # type: ignore[arg-type]
        lora.target_modules,
        fan_in_fan_out=lora.fan_in_fan_out,
    )
    written = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert written == json.loads(json.dumps(config))
    assert written["fan_in_fan_out"] is (family == "gpt2")

    with warnings.catch_warnings():
        # PEFT warns (and then corrects the flag) when fan_in_fan_out disagrees with the layer.
        warnings.filterwarnings("error", message=".*fan_in_fan_out.*")
        loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter"))
    assert set(get_peft_model_state_dict(loaded)) == set(lora.slot_state_dict(idx))
    ids = _ids(2)
    with torch.no_grad(), lora.use([idx, idx]):
        ours = model(input_ids=ids).logits
    with torch.no_grad():
        theirs = loaded(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapter_keys_are_the_module_paths_vllm_reads(family, randomize):
    from transformers.pytorch_utils import Conv1D

    base, _, lora = _multi(family, randomize)
    modules = dict(base.named_modules())
    expected_layers = LAYER_0[family] + [n.replace(".0.", ".1.", 1) for n in LAYER_0[family]]
    assert sorted(lora.layers) == sorted(expected_layers)
    for name in expected_layers:
        assert isinstance(modules[name], torch.nn.Linear | Conv1D)
    expected_keys = {peft_key(n, m) for n in expected_layers for m in ("lora_A", "lora_B")}
    state = lora.slot_state_dict(0)
    assert set(state) == expected_keys
    for name in expected_layers:
        layer = lora.layers[name]
        assert state[peft_key(name, "lora_A")].shape == (8, layer.in_features)
        assert state[peft_key(name, "lora_B")].shape == (layer.out_features, 8)
