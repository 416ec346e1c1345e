"""The multi-LoRA layer and its slots on layers of a few features: shapes, checks and their
messages, which kernel runs, what a slot exports and loads, and the gather path's copies.

No model is loaded (test_model_lora.py compares the layers inside one against PEFT).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from schemas.config import DEFAULT_TARGET_MODULES
from services.model import lora as lora_module
from services.model.families import default_target_modules
from services.model.lora import MultiLoRA, MultiLoRALinear, _grouped_mm_fits, peft_key, preview_keys
from services.model.routing import AdapterContext


class Toy(nn.Module):
    """Two targets of DEFAULT_TARGET_MODULES, one with a bias, and a layer that is none."""

    def __init__(self, conv1d: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q_proj = nn.Linear(4, 8, dtype=torch.float64)
        self.v_proj = Conv1D(4, 4).double() if conv1d else nn.Linear(4, 4, bias=False).double()
        self.head = nn.Linear(8, 2, dtype=torch.float64)


class GptToy(nn.Module):
    """GPT-2's layer names, one of them a Conv1D, and its model_type."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type="gpt2")
        self.c_attn = Conv1D(12, 4)
        self.c_proj = nn.Linear(4, 4)
        self.c_fc = nn.Linear(4, 8)
        self.q_proj = nn.Linear(4, 4)  # a name of the default targets, not of gpt2's


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def test_peft_key_and_preview_keys():
    assert (
        peft_key("model.layers.0.q_proj", "lora_A")
        == "base_model.model.model.layers.0.q_proj.lora_A.weight"
    )
    keys = ["a", "b", "c", "d", "e", "f"]
    assert preview_keys([]) == "none"
    assert preview_keys(keys[:4]) == "a, b, c, d"
    assert preview_keys(keys[:5]) == "a, b, c, d (+1 more)"
    assert preview_keys(keys, limit=2) == "a, b (+4 more)"


def test_a_layer_wraps_a_linear_or_a_conv1d_only_and_shares_a_matching_context():
    base = nn.Linear(3, 5, dtype=torch.float64)
    layer = MultiLoRALinear(base, n_adapters=2, max_rank=4)
    assert layer.base_layer is base and not any(p.requires_grad for p in base.parameters())
    assert (layer.in_features, layer.out_features, layer.fan_in_fan_out) == (3, 5, False)
    ctx = layer.adapter_context
    assert (ctx.n_adapters, ctx.max_rank) == (2, 4)
    assert layer.extra_repr() == "in_features=3, out_features=5, n_adapters=2, max_rank=4"
    assert len(layer.lora_A) == len(layer.lora_B) == 2
    for a, b in zip(layer.lora_A, layer.lora_B, strict=True):
        assert (a.shape, b.shape) == ((4, 3), (5, 4))
        assert a.dtype == b.dtype == torch.float64 and a.requires_grad and b.requires_grad
        assert torch.count_nonzero(a) == torch.count_nonzero(b) == 0
    assert layer.stacked is None

    shared = AdapterContext(2, 4)
    assert MultiLoRALinear(nn.Linear(3, 5), 2, 4, shared).adapter_context is shared
    with pytest.raises(
        ValueError,
        match=r"^adapter context has 2 slots of max rank 4, the layer wants 3 of max rank 4$",
    ):
        MultiLoRALinear(nn.Linear(3, 5), 3, 4, shared)
    with pytest.raises(ValueError, match=r"the layer wants 2 of max rank 2$"):
        MultiLoRALinear(nn.Linear(3, 5), 2, 2, shared)
    with pytest.raises(TypeError, match=r"wraps nn\.Linear and Conv1D .*, got .*Conv2d"):
        MultiLoRALinear(nn.Conv2d(1, 1, 1), 2, 4)

    conv = MultiLoRALinear(Conv1D(5, 3), n_adapters=1, max_rank=2)  # weight [in 3, out 5]
    assert (conv.in_features, conv.out_features, conv.fan_in_fan_out) == (3, 5, True)


def test_load_slot_pads_past_the_rank_clears_gradients_and_checks_shapes():
    layer = MultiLoRALinear(nn.Linear(3, 2, dtype=torch.float64), n_adapters=2, max_rank=3)
    for p in [*layer.lora_A, *layer.lora_B]:
        p.grad = torch.ones_like(p)
        with torch.no_grad():
            p.fill_(9.0)
    a = torch.arange(6.0, dtype=torch.float64).reshape(2, 3) + 1
    b = -torch.arange(4.0, dtype=torch.float64).reshape(2, 2) - 1
    layer.load_slot(1, a, b)
    assert torch.equal(layer.lora_A[1], torch.cat([a, torch.zeros(1, 3, dtype=torch.float64)]))
    assert torch.equal(layer.lora_B[1], torch.cat([b, torch.zeros(2, 1, dtype=torch.float64)], 1))
    assert layer.lora_A[1].grad is None and layer.lora_B[1].grad is None
    assert torch.all(layer.lora_A[0] == 9.0) and layer.lora_A[0].grad is not None  # untouched

    layer.load_slot(0, a[:1], b[:, :1])  # rank 1
    layer.load_slot(0, torch.ones(3, 3), torch.ones(2, 3))  # rank 3, the max
    with pytest.raises(ValueError, match=r"^lora_A of shape \[4, 3\] does not fit \[r <= 3, 3\]$"):
        layer.load_slot(0, torch.ones(4, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"lora_A of shape \[0, 3\]"):
        layer.load_slot(0, torch.ones(0, 3), torch.ones(2, 0))
    with pytest.raises(ValueError, match=r"lora_A of shape \[2, 4\]"):
        layer.load_slot(0, torch.ones(2, 4), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"^lora_B of shape \[2, 3\], expected \[2, 2\]$"):
        layer.load_slot(0, torch.ones(2, 3), torch.ones(2, 3))


def test_reset_slot_is_kaiming_uniform_from_the_generator_and_b_zero():
    layer = MultiLoRALinear(nn.Linear(6, 2), n_adapters=1, max_rank=4)
    layer.reset_slot(0, 3, torch.Generator().manual_seed(5))
    expected = torch.empty(3, 6)
    nn.init.kaiming_uniform_(expected, a=math.sqrt(5), generator=torch.Generator().manual_seed(5))
    assert torch.equal(layer.lora_A[0][:3], expected)
    assert torch.count_nonzero(layer.lora_A[0][3:]) == 0
    assert torch.count_nonzero(layer.lora_B[0]) == 0


def test_which_kernel_multiplies_the_segments():
    f32, f64, bf16 = (
        torch.zeros(1, dtype=d) for d in (torch.float32, torch.float64, torch.bfloat16)
    )
    assert _grouped_mm_fits(f64, (3, 5, 7), "grouped_mm")
    assert not _grouped_mm_fits(f32, (4, 4, 4), "bmm")
    assert _grouped_mm_fits(f32, (4, 8, 12), "auto")  # rows of 16, 32 and 48 bytes
    assert not _grouped_mm_fits(f32, (4, 8, 2), "auto")  # 8 bytes: not aligned
    assert not _grouped_mm_fits(f32, (6, 4, 4), "auto")
    assert _grouped_mm_fits(bf16, (8, 16, 8), "auto")
    assert not _grouped_mm_fits(bf16, (8, 16, 4), "auto")
    assert not _grouped_mm_fits(f64, (2, 2, 2), "auto")  # aligned, but no CPU grouped_mm
    assert not _grouped_mm_fits(torch.zeros(1, device="meta"), (4, 4, 4), "auto")
    # bfloat16 off the CPU asks for a Hopper-class GPU only on CUDA
    meta_bf16 = torch.zeros(1, device="meta", dtype=torch.bfloat16)
    assert not _grouped_mm_fits(meta_bf16, (8, 16, 8), "auto")


@pytest.mark.parametrize(
    ("capability", "dtype", "fits"),
    [
        ((9, 0), torch.bfloat16, True),  # Hopper
        ((10, 0), torch.bfloat16, True),  # Blackwell
        ((8, 9), torch.bfloat16, False),  # Ada: no grouped_mm
        ((9, 0), torch.float32, False),  # bfloat16 only
    ],
)
def test_on_cuda_grouped_mm_needs_bfloat16_and_a_hopper_class_device(
    monkeypatch, capability, dtype, fits
):
    """The CUDA branch, on a machine without one: the operand stands for a tensor on the
    second GPU (its device, dtype and element size are all the choice reads), and the device's
    compute capability is the one asked of that device."""
    asked = []

    def get_device_capability(device=None):
        asked.append(device)
        return capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    element = torch.zeros(1, dtype=dtype).element_size()
    x = SimpleNamespace(device=torch.device("cuda", 1), dtype=dtype, element_size=lambda: element)
    assert _grouped_mm_fits(x, (8, 16, 8), "auto") is fits
    assert asked in ([torch.device("cuda", 1)], [])
    assert bool(asked) is (dtype == torch.bfloat16)


@pytest.mark.parametrize("kernel", ["bmm", "grouped_mm"])
def test_a_layer_without_slot_ids_is_its_base_and_with_them_adds_each_slots_delta(
    kernel, monkeypatch
):
    """Each kernel gives each row its slot's delta, and the kernel asked for is the one that
    multiplies the segments (both give the same numbers; only their speed tells them apart)."""
    grouped = []
    segment_lora = lora_module.SegmentLoRA.apply
    monkeypatch.setattr(
        lora_module.SegmentLoRA, "apply", lambda *a: grouped.append(1) or segment_lora(*a)
    )
    torch.manual_seed(1)
    base = nn.Linear(4, 8)
    layer = MultiLoRALinear(base, n_adapters=2, max_rank=4)
    layer.adapter_context.kernel = kernel
    a0, b0 = torch.randn(4, 4), torch.randn(8, 4)
    a1, b1 = torch.randn(2, 4), torch.randn(8, 2)
    layer.load_slot(0, a0, b0)
    layer.load_slot(1, a1, b1)
    layer.adapter_context.configure_slot(1, 2, 3.0)
    x = torch.randn(3, 2, 4)
    assert torch.equal(layer(x), base(x))
    layer.adapter_context.set_slot_ids([1, -1, 0])
    out = layer(x)
    torch.testing.assert_close(out[0], base(x[0]) + 1.5 * x[0] @ a1.T @ b1.T)
    assert torch.equal(out[1], base(x[1]))
    torch.testing.assert_close(out[2], base(x[2]) + 1.0 * x[2] @ a0.T @ b0.T)
    assert len(grouped) == (kernel == "grouped_mm"), grouped


def test_the_slots_are_made_on_the_base_layers_device_in_its_dtype():
    base = nn.Linear(4, 8, device="meta", dtype=torch.bfloat16)
    layer = MultiLoRALinear(base, n_adapters=2, max_rank=3)
    for p in [*layer.lora_A, *layer.lora_B]:
        assert (p.device.type, p.dtype) == ("meta", torch.bfloat16)


@pytest.mark.parametrize("kernel", ["bmm", "grouped_mm"])
def test_a_bfloat16_layer_adds_its_slots_deltas_in_bfloat16_on_either_kernel(kernel):
    """Operands of one dtype all the way: the slot scales are made in the input's dtype (the
    grouped kernel refuses a float32 operand beside bfloat16 ones)."""
    torch.manual_seed(2)
    base = nn.Linear(8, 16).to(torch.bfloat16)
    layer = MultiLoRALinear(base, n_adapters=2, max_rank=8)
    layer.adapter_context.kernel = kernel
    a, b = torch.randn(8, 8).bfloat16(), torch.randn(16, 8).bfloat16()
    layer.load_slot(1, a, b)
    layer.adapter_context.configure_slot(1, 8, 16.0)
    layer.adapter_context.set_slot_ids([1, -1, 1])
    x = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    delta = 2.0 * x.float() @ a.float().T @ b.float().T
    for i, slot in enumerate([1, -1, 1]):
        expected = base(x[i]).float() + (delta[i] if slot == 1 else 0.0)
        torch.testing.assert_close(out[i].float(), expected, rtol=3e-2, atol=3e-2)


def test_attach_takes_the_familys_targets_and_starts_every_slot_fresh():
    toy = Toy()
    lora = MultiLoRA.attach(toy, n_adapters=2, max_rank=3)
    assert lora.target_modules == DEFAULT_TARGET_MODULES  # no config: the default targets
    assert list(lora.layers) == ["q_proj", "v_proj"] and toy.q_proj is lora.layers["q_proj"]
    assert lora.model is toy
    with pytest.raises(ValueError, match=r"^the model already carries multi-LoRA layers$"):
        MultiLoRA.attach(toy, n_adapters=2, max_rank=3)
    assert isinstance(toy.head, nn.Linear) and not toy.head.weight.requires_grad
    assert (lora.n_adapters, lora.max_rank) == (2, 3)
    for idx in range(2):
        assert (lora.slot_rank(idx), lora.context.alpha(idx)) == (3, 3.0)
        for layer in lora.layers.values():
            assert torch.count_nonzero(layer.lora_A[idx]) == layer.lora_A[idx].numel()
            assert torch.count_nonzero(layer.lora_B[idx]) == 0
    assert lora.layers["q_proj"].adapter_context is lora.layers["v_proj"].adapter_context

    llama = Toy()
    llama.config = SimpleNamespace(model_type="llama")  # type: ignore[assignment]
    got = MultiLoRA.attach(llama, n_adapters=1, max_rank=1).target_modules
    assert got == default_target_modules("llama")
    unnamed = Toy()
    unnamed.config = SimpleNamespace(model_type="")  # type: ignore[assignment]
    assert MultiLoRA.attach(unnamed, 1, 1).target_modules == DEFAULT_TARGET_MODULES
    gpt2 = MultiLoRA.attach(GptToy(), n_adapters=1, max_rank=2)  # the family's own targets
    assert gpt2.target_modules == default_target_modules("gpt2") == ("c_attn", "c_proj", "c_fc")
    assert list(gpt2.layers) == ["c_attn", "c_proj", "c_fc"] and gpt2.fan_in_fan_out
    only = MultiLoRA.attach(Toy(), 1, 2, target_modules=["v_proj"])
    assert list(only.layers) == ["v_proj"] and only.target_modules == ("v_proj",)


def test_adapter_config_says_rank_alpha_targets_and_the_weight_layout():
    lora = MultiLoRA.attach(Toy(), n_adapters=2, max_rank=4, target_modules=["v_proj", "q_proj"])
    lora.reset_slot(1, 2, 5.0, seed=1)
    config = lora.adapter_config(1, "/models/toy")
    assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (2, 5.0, False)
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == "/models/toy"
    assert lora.adapter_config(0)["r"] == 4 and lora.adapter_config(0)["lora_alpha"] == 4.0
    assert lora.adapter_config(0)["base_model_name_or_path"] is None  # no path given
    # a Conv1D among the targets stores its weight [in, out]: PEFT must be told
    mixed = MultiLoRA.attach(Toy(conv1d=True), n_adapters=1, max_rank=2)
    assert mixed.fan_in_fan_out and mixed.adapter_config(0)["fan_in_fan_out"] is True


def test_use_restores_the_previous_slot_ids_even_on_error():
    lora = MultiLoRA.attach(Toy(), n_adapters=2, max_rank=2)
    lora.set_slot_ids([1])
    with lora.use([0, -1]):
        assert lora.context.slot_ids.tolist() == [0, -1]  # type: ignore[union-attr]
    assert lora.context.slot_ids.tolist() == [1]  # type: ignore[union-attr]
    with pytest.raises(RuntimeError), lora.use(None):
        assert lora.context.slot_ids is None
        raise RuntimeError
    assert lora.context.slot_ids.tolist() == [1]  # type: ignore[union-attr]
    lora.set_slot_ids(None)
    assert lora.context.slot_ids is None


def test_a_slot_exports_detached_trimmed_copies_and_loads_back_only_when_it_fits():
    lora = MultiLoRA.attach(Toy(), n_adapters=2, max_rank=3)
    lora.reset_slot(0, 2, 4.0, seed=7)
    with torch.no_grad():
        for layer in lora.layers.values():
            layer.lora_B[0][:, :2].normal_(generator=torch.Generator().manual_seed(2))
    state = lora.slot_state_dict(0)
    q = lora.layers["q_proj"]
    assert list(state) == [
        peft_key("q_proj", "lora_A"),
        peft_key("q_proj", "lora_B"),
        peft_key("v_proj", "lora_A"),
        peft_key("v_proj", "lora_B"),
    ]
    a, b = state[peft_key("q_proj", "lora_A")], state[peft_key("q_proj", "lora_B")]
    assert torch.equal(a, q.lora_A[0][:2]) and torch.equal(b, q.lora_B[0][:, :2])
    assert b.is_contiguous() and not a.requires_grad
    a.add_(1.0)  # a copy: the slot does not change
    assert not torch.equal(a, q.lora_A[0][:2])
    a.sub_(1.0)
    full = lora.slot_state_dict(1)[peft_key("q_proj", "lora_B")]  # rank 3 of 3: B not sliced
    full.add_(1.0)  # a copy too
    assert torch.count_nonzero(q.lora_B[1]) == 0
    names = [n for n, _ in lora.slot_named_parameters(1)]
    assert names == ["q_proj.lora_A.1", "q_proj.lora_B.1", "v_proj.lora_A.1", "v_proj.lora_B.1"]
    assert lora.slot_parameters(1)[1] is q.lora_B[1]
    with pytest.raises(IndexError, match=r"adapter slot 2 out of range 0\.\.1"):
        lora.slot_named_parameters(2)

    before = [p.detach().clone() for p in lora.slot_parameters(1)]
    for rank in (0, 4):
        with pytest.raises(
            ValueError, match=rf"^rank {rank} of slot 1 must be in 1\.\.3 \(max_rank\)$"
        ):
            lora.load_slot_state_dict(1, state, rank=rank, alpha=4.0)
    with pytest.raises(IndexError, match="adapter slot 5 out of range"):
        lora.load_slot_state_dict(5, state, rank=2, alpha=4.0)
    extra = dict(state, **{peft_key("head", "lora_A"): torch.zeros(2, 8)})
    with pytest.raises(
        ValueError,
        match=r"^adapter for slot 1 does not fit this model: missing keys none, "
        r"unexpected keys base_model\.model\.head\.lora_A\.weight$",
    ):
        lora.load_slot_state_dict(1, extra, rank=2, alpha=4.0)
    with pytest.raises(
        ValueError,
        match=r"missing keys base_model\.model\.q_proj\.lora_A\.weight, unexpected keys none$",
    ):
        lora.load_slot_state_dict(
            1, {k: v for k, v in state.items() if "q_proj.lora_A" not in k}, 2, 4.0
        )
    with pytest.raises(
        ValueError,
        match=r"^adapter for slot 1: base_model\.model\.q_proj\.lora_A\.weight has shape \[2, 4\], "
        r"expected \[3, 4\] \(rank 3\)$",
    ):
        lora.load_slot_state_dict(1, state, rank=3, alpha=4.0)
    assert all(torch.equal(p, q) for p, q in zip(before, lora.slot_parameters(1), strict=True))
    assert (lora.slot_rank(1), lora.context.alpha(1)) == (3, 3.0)

    lora.load_slot_state_dict(1, state, rank=2, alpha=4.0)
    assert (lora.slot_rank(1), lora.context.alpha(1)) == (2, 4.0)
    assert all(
        torch.equal(p, q)
        for p, q in zip(lora.slot_parameters(0), lora.slot_parameters(1), strict=True)
    )
    lora.reset_slot(0, 1, 2.0, seed=1)
    lora.load_slot_state_dict(1, lora.slot_state_dict(0), rank=1, alpha=2.0)  # the least rank
    assert (lora.slot_rank(1), lora.context.alpha(1)) == (1, 2.0)


def test_the_gather_paths_copies_follow_every_reset_and_load():
    toy = Toy()
    lora = MultiLoRA.attach(toy, n_adapters=2, max_rank=3)
    with torch.no_grad():
        for layer in lora.layers.values():
            for b in layer.lora_B:
                b.normal_(generator=torch.Generator().manual_seed(4))
    lora.stack_slots()
    assert all(layer.stacked is not None for layer in lora.layers.values())
    lora.reset_slot(0, 2, 6.0, seed=3)  # B zero again: slot 0 adds nothing
    state = lora.slot_state_dict(0)
    for key in [k for k in state if ".lora_B." in k]:
        state[key] = torch.randn(state[key].shape, dtype=torch.float64)
    lora.load_slot_state_dict(1, state, rank=2, alpha=5.0)
    x = _x(4, 4)
    slots = torch.tensor([0, 1, -1, 1])
    with torch.no_grad():
        lora.set_slot_ids(slots.view(4, 1))
        routed = toy.q_proj(x.view(4, 1, 4)).view(4, 8)
        lora.set_slot_ids(None)
        lora.context.set_gather_slots(slots)
        gathered = toy.q_proj(x)
    torch.testing.assert_close(gathered, routed)
    torch.testing.assert_close(gathered[2], toy.q_proj.base_layer(x[2]))  # slot -1: the base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_slot_is_exported_to_the_cpu():
    lora = MultiLoRA.attach(Toy().cuda(), n_adapters=1, max_rank=2)
    state = lora.slot_state_dict(0)
    assert {t.device.type for t in state.values()} == {"cpu"}
    assert torch.equal(state[peft_key("q_proj", "lora_A")], lora.layers["q_proj"].lora_A[0].cpu())
