"""The multi-adapter LoRA layer matches PEFT's LoRA slot by slot and keeps the slots apart."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from services.model.lora import MultiLoRALinear, peft_key

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

# slot -> (rank, alpha); max_rank is 8 and slot 3 stays unused by the mixed batch.
SLOTS = {0: (8, 16.0), 1: (4, 4.0), 2: (2, 7.5)}
BATCH_SLOTS = [0, 2, -1, 1, 0, 2]
SEQ_LEN = 10


def _batch(seed: int = 0, batch: int = len(BATCH_SLOTS)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 90, (batch, SEQ_LEN), generator=generator)


def _loss_weights(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7))


def _grad(tensor: torch.Tensor) -> torch.Tensor:
    assert tensor.grad is not None
    return tensor.grad.clone()


def _peft_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name.replace(".default", ""): p.grad
        for name, p in model.named_parameters()
        if "lora_" in name and p.grad is not None
    }


@pytest.mark.parametrize(
    ("dtype", "tol"),
    # float32 runs grouped_mm; float64 has no grouped_mm kernel and takes the bmm path, where
    # agreement to 1e-10 shows the float32 differences are rounding alone.
    [(torch.float32, 1e-5), (torch.float64, 1e-10)],
    ids=["float32", "float64"],
)
def test_mixed_batch_matches_single_adapter_peft(multi_lora, peft_reference, randomize, dtype, tol):
    model, lora = multi_lora(n_adapters=4, max_rank=8, dtype=dtype)
    for idx, (rank, alpha) in SLOTS.items():
        randomize(lora, idx, rank, alpha, seed=idx)
    ids = _batch()
    weights = _loss_weights(torch.Size([*ids.shape, 90])).to(dtype)
    # A token-mean loss, as the trainer's, keeps gradients O(0.1) so that the absolute tolerance
    # means the same for logits and gradients; the denominator is the whole batch's for both.
    num_tokens = ids.numel()
    with lora.use(BATCH_SLOTS):
        logits = model(input_ids=ids).logits
    ((logits * weights).sum() / num_tokens).backward()

    for idx, (rank, alpha) in SLOTS.items():
        rows = [b for b, s in enumerate(BATCH_SLOTS) if s == idx]
        reference = peft_reference(lora.slot_state_dict(idx), rank, alpha, dtype=dtype)
        ref_logits = reference(input_ids=ids[rows]).logits
        torch.testing.assert_close(logits[rows], ref_logits, atol=tol, rtol=tol)
        ((ref_logits * weights[rows]).sum() / num_tokens).backward()
        ref_grads = _peft_grads(reference)
        assert len(ref_grads) == 2 * len(lora.layers)
        for name, layer in lora.layers.items():
            grad_a, grad_b = layer.lora_A[idx].grad, layer.lora_B[idx].grad
            assert grad_a is not None and grad_b is not None
            torch.testing.assert_close(
                grad_a[:rank], ref_grads[peft_key(name, "lora_A")], atol=tol, rtol=tol
            )
            torch.testing.assert_close(
                grad_b[:, :rank], ref_grads[peft_key(name, "lora_B")], atol=tol, rtol=tol
            )
            assert grad_a[:rank].abs().max() > 1e-4 and grad_b[:, :rank].abs().max() > 1e-4
            # The padding past the slot's rank gets exactly zero gradient.
            assert torch.count_nonzero(grad_a[rank:]) == 0
            assert torch.count_nonzero(grad_b[:, rank:]) == 0
    # A slot no sequence uses takes no part in the graph.
    assert all(p.grad is None for p in lora.slot_parameters(3))


def test_no_adapter_sequence_equals_base_model_exactly(multi_lora, randomize, tiny_dir):
    from services.model.loader import load_model

    base, _ = load_model(tiny_dir)
    model, lora = multi_lora(n_adapters=4, max_rank=8)
    for idx, (rank, alpha) in SLOTS.items():
        randomize(lora, idx, rank, alpha, seed=idx)
    ids = _batch()
    with torch.no_grad(), lora.use(BATCH_SLOTS):
        mixed = model(input_ids=ids).logits
    with torch.no_grad():
        expected = base(input_ids=ids).logits
    assert torch.equal(mixed[2], expected[2])
    assert not torch.allclose(mixed[0], expected[0], atol=1e-3)
    with torch.no_grad(), lora.use(None):
        assert torch.equal(model(input_ids=ids).logits, expected)


def test_reset_slot_is_peft_init_and_behaves_as_base(multi_lora, randomize):
    model, lora = multi_lora(n_adapters=2, max_rank=8)
    randomize(lora, 1, 8, 16.0, seed=3)
    lora.reset_slot(1, rank=4, alpha=8.0, seed=11)
    assert (lora.slot_rank(1), lora.context.alpha(1)) == (4, 8.0)
    for layer in lora.layers.values():
        a, b = layer.lora_A[1], layer.lora_B[1]
        assert torch.count_nonzero(b) == 0
        assert torch.count_nonzero(a[4:]) == 0
        # kaiming_uniform(a=sqrt(5)) on [r, in] draws from U(-1/sqrt(in), 1/sqrt(in)).
        bound = 1.0 / math.sqrt(layer.in_features)
        assert 0.5 * bound < a[:4].abs().max() <= bound
    ids = _batch(batch=2)
    with torch.no_grad(), lora.use([1, 1]):
        adapted = model(input_ids=ids).logits
    with torch.no_grad(), lora.use([-1, -1]):
        base = model(input_ids=ids).logits
    assert torch.equal(adapted, base)

    first = [p.detach().clone() for p in lora.slot_parameters(1)]
    lora.reset_slot(1, rank=4, alpha=8.0, seed=11)
    assert all(torch.equal(p, q) for p, q in zip(first, lora.slot_parameters(1), strict=True))


def _train(model, lora, idx: int, slot_ids: list[int], steps: int) -> None:
    optimizer = torch.optim.AdamW(lora.slot_parameters(idx), lr=1e-2, weight_decay=0.1)
    ids = _batch(batch=len(slot_ids))
    for _ in range(steps):
        optimizer.zero_grad()
        with lora.use(slot_ids):
            logits = model(input_ids=ids).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        optimizer.step()


def test_padding_past_rank_stays_zero_under_adamw(multi_lora):
    model, lora = multi_lora(n_adapters=2, max_rank=8)
    lora.reset_slot(0, rank=3, alpha=6.0, seed=0)
    before = [p.detach().clone() for p in lora.slot_parameters(0)]
    _train(model, lora, 0, [0, 0, 0], steps=4)
    for layer in lora.layers.values():
        assert torch.count_nonzero(layer.lora_A[0][3:]) == 0
        assert torch.count_nonzero(layer.lora_B[0][:, 3:]) == 0
        assert torch.count_nonzero(layer.lora_B[0][:, :3]) > 0
    after = lora.slot_parameters(0)
    assert all(not torch.equal(p, q) for p, q in zip(before, after, strict=True))


def test_training_one_slot_leaves_another_bit_identical(multi_lora, randomize):
    model, lora = multi_lora(n_adapters=3, max_rank=8)
    randomize(lora, 0, 8, 16.0, seed=0)
    randomize(lora, 1, 4, 8.0, seed=1)
    other = [p.detach().clone() for p in lora.slot_parameters(1)]
    trained = [p.detach().clone() for p in lora.slot_parameters(0)]
    # Slot 1 shares every batch, so it receives gradients; only its own optimizer may move it.
    _train(model, lora, 0, [0, 1, 0, 1], steps=5)
    assert all(p.grad is not None for p in lora.slot_parameters(1))
    assert all(torch.equal(p, q) for p, q in zip(other, lora.slot_parameters(1), strict=True))
    assert all(not torch.equal(p, q) for p, q in zip(trained, lora.slot_parameters(0), strict=True))


@pytest.mark.parametrize("input_grad", [True, False], ids=["input-grad", "frozen-input"])
@pytest.mark.parametrize("slot_ids", [[0, 0, 0], [1, 0, -1]], ids=["sorted", "permuted"])
def test_stride0_gradient_from_sum_matches_dense_gradient(slot_ids, input_grad):
    # ``out.sum()`` straight after the layer hands it a stride-0 gradient, which grouped_mm's
    # backward cannot take; inside a model the lm_head usually hides this.
    torch.manual_seed(0)
    layer = MultiLoRALinear(nn.Linear(8, 12), n_adapters=2, max_rank=4)
    layer.adapter_context.kernel = "grouped_mm"
    for idx in range(2):
        layer.load_slot(idx, torch.randn(4, 8), torch.randn(12, 4))
    layer.adapter_context.set_slot_ids(slot_ids)
    x = torch.randn(3, 5, 8, requires_grad=input_grad)
    grads = []
    for dense in (False, True):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)
        (out * torch.ones_like(out)).sum().backward() if dense else out.sum().backward()
        tensors = [layer.lora_A[0], layer.lora_B[0], *([x] if input_grad else [])]
        grads.append([_grad(t) for t in tensors])
    for sum_grad, dense_grad in zip(*grads, strict=True):
        torch.testing.assert_close(sum_grad, dense_grad, atol=1e-6, rtol=1e-6)


def test_bmm_kernel_matches_grouped_mm(multi_lora, randomize):
    model, lora = multi_lora(n_adapters=3, max_rank=8)
    for idx, (rank, alpha) in SLOTS.items():
        randomize(lora, idx, rank, alpha, seed=idx)
    ids = _batch()
    results = []
    for kernel in ("grouped_mm", "bmm"):
        lora.context.kernel = kernel
        model.zero_grad(set_to_none=True)
        with lora.use(BATCH_SLOTS):
            logits = model(input_ids=ids).logits
        ((logits * _loss_weights(logits.shape)).sum() / ids.numel()).backward()
        results.append((logits.detach(), [_grad(p) for p in lora.slot_parameters(2)]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for grouped, padded in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(grouped, padded, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["grouped_mm", "bmm"])
def test_layer_with_per_token_slots_applies_the_formula(kernel):
    torch.manual_seed(0)
    layer = MultiLoRALinear(nn.Linear(8, 4), n_adapters=3, max_rank=4)
    context = layer.adapter_context
    context.kernel = kernel
    context.configure_slot(0, rank=4, alpha=2.0)
    context.configure_slot(2, rank=2, alpha=3.0)
    a0, b0 = torch.randn(4, 8), torch.randn(4, 4)
    a2, b2 = torch.randn(2, 8), torch.randn(4, 2)
    layer.load_slot(0, a0, b0)
    layer.load_slot(2, a2, b2)
    x = torch.randn(2, 3, 8)
    slots = torch.tensor([[2, -1, 0], [0, 2, 2]])
    context.set_slot_ids(slots)
    out = layer(x)
    for bi in range(2):
        for t in range(3):
            expected = layer.base_layer(x[bi, t])
            if slots[bi, t] == 0:
                expected = expected + (2.0 / 4) * (b0 @ (a0 @ x[bi, t]))
            elif slots[bi, t] == 2:
                expected = expected + (3.0 / 2) * (b2 @ (a2 @ x[bi, t]))
            torch.testing.assert_close(out[bi, t], expected, atol=1e-6, rtol=1e-6)


def test_slot_ids_are_checked():
    layer = MultiLoRALinear(nn.Linear(4, 4), n_adapters=2, max_rank=2)
    with pytest.raises(ValueError, match=r"-1\.\.1"):
        layer.adapter_context.set_slot_ids([0, 2])
    layer.adapter_context.set_slot_ids([0, 1, 0])
    with pytest.raises(ValueError, match="one slot id per sequence"):
        layer(torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match=r"rank 3 of slot 0 must be in 1\.\.2"):
        layer.adapter_context.configure_slot(0, rank=3, alpha=1.0)


def test_attach_freezes_the_base_and_names_slot_parameters(multi_lora):
    model, lora = multi_lora(n_adapters=3, max_rank=4)
    assert (
        len(lora.layers) == 7 * 2 and next(iter(lora.layers)) == "model.layers.0.self_attn.q_proj"
    )
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 3 * 2 * len(lora.layers)
    assert all(".lora_A." in name or ".lora_B." in name for name in trainable)
    by_name = dict(model.named_parameters())
    named = lora.slot_named_parameters(2)
    assert len(named) == 2 * len(lora.layers)
    assert all(by_name[name] is p for name, p in named)
    assert named[0][0] == "model.layers.0.self_attn.q_proj.lora_A.2"
    # Every slot starts as a fresh PEFT adapter: behaves as the base model until trained.
    assert all(torch.count_nonzero(p) == 0 for name, p in named if ".lora_B." in name)
    with pytest.raises(ValueError, match="already carries multi-LoRA layers"):
        type(lora).attach(model, n_adapters=1, max_rank=1)


def test_attach_needs_a_matching_linear(tiny_dir):
    from services.model.loader import load_model
    from services.model.lora import MultiLoRA

    model, _ = load_model(tiny_dir)
    with pytest.raises(ValueError, match=r"matches target_modules \['c_attn'\]"):
        MultiLoRA.attach(model, n_adapters=2, max_rank=4, target_modules=["c_attn"])
    lora = MultiLoRA.attach(model, n_adapters=2, max_rank=4, target_modules=["self_attn.o_proj"])
    assert list(lora.layers) == [
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.o_proj",
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_on_a_gpu_both_kernels_apply_the_formula_and_agree_on_gradients(dtype):
    """On a GPU, ``auto`` picks grouped_mm for bfloat16 on a Hopper-class device and the padded
    bmm otherwise: each must give the formula's output and the same slot gradients as the other
    (a stride-0 gradient from ``out.sum()`` included)."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    layer = MultiLoRALinear(nn.Linear(64, 32, device=device, dtype=dtype), 3, max_rank=8)
    context = layer.adapter_context
    context.configure_slot(0, rank=8, alpha=16.0)
    context.configure_slot(2, rank=4, alpha=3.0)
    a0, b0, a2, b2 = (torch.randn(shape) for shape in ((8, 64), (32, 8), (4, 64), (32, 4)))
    layer.load_slot(0, a0, b0)
    layer.load_slot(2, a2, b2)
    x = torch.randn(3, 5, 64)
    slots = torch.tensor([2, -1, 0])
    expected = layer.base_layer(x.to(device, dtype)).float().cpu()
    delta = {0: (16.0 / 8) * (x @ a0.T @ b0.T), 2: (3.0 / 4) * (x @ a2.T @ b2.T)}
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[row] += delta[slot][row]
    # bfloat16 keeps 8 bits of mantissa: compare within 1% of each tensor's largest value.
    rel = 1e-2 if dtype == torch.bfloat16 else 1e-4
    grads = []
    for kernel in ("auto", "bmm"):
        context.kernel = kernel
        context.set_slot_ids(slots)
        layer.zero_grad(set_to_none=True)
        out = layer(x.to(device, dtype))
        atol = rel * expected.abs().max().item()
        torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rel)
        out.sum().backward()
        assert layer.lora_A[1].grad is None and layer.lora_B[1].grad is None  # no token of 1
        used = (layer.lora_A[0], layer.lora_A[2], layer.lora_B[0], layer.lora_B[2])
        grads.append([_grad(p).float().cpu() for p in used])
    for auto, padded in zip(*grads, strict=True):
        assert auto.abs().max() > 0
        torch.testing.assert_close(auto, padded, atol=rel * padded.abs().max().item(), rtol=rel)
