"""The decode path's Triton kernels against the torch references, on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py before triton is imported), so CI
checks them without a GPU."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.model import triton_kernels
from services.model.lora_gather import StackedSlots, gathered_delta
from services.model.paged_kv import PagedKVCache, paged_attention_reference, reference_layout

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None,
        reason="triton is not installed (the dev extra installs it: bash scripts/bootstrap.sh)",
    ),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="a CUDA device is present: the kernels are tested compiled (pytest -m gpu)",
    ),
]


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_kernels, "CPU_INTERPRETER", True)
    assert triton_kernels.usable(torch.device("cpu"))


def test_unless_asked_for_a_cpu_takes_the_torch_path(monkeypatch) -> None:
    monkeypatch.setattr(triton_kernels, "CPU_INTERPRETER", False)
    assert not triton_kernels.usable(torch.device("cpu"))


def test_shrink_and_expand_add_each_tokens_own_slot(interpret) -> None:
    gen = torch.Generator().manual_seed(0)
    n, rank, n_in, n_out = 3, 8, 48, 40  # sizes that are no multiple of the kernels' tiles
    stacked = StackedSlots(
        a=torch.randn(n, rank, n_in, generator=gen), b=torch.randn(n, rank, n_out, generator=gen)
    )
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2])
    x = torch.randn(len(slots), n_in, generator=gen)
    base = torch.randn(len(slots), n_out, generator=gen)
    out = base.clone()
    h = triton_kernels.lora_shrink(x, stacked.a, slots)
    triton_kernels.lora_expand(out, h, stacked.b, slots)
    torch.testing.assert_close(out, base + gathered_delta(x, stacked, slots), atol=1e-4, rtol=1e-4)
    # By hand for one token of slot 2, and the base rows of slot -1 untouched, bit for bit.
    torch.testing.assert_close(
        out[0], base[0] + (stacked.a[2] @ x[0]) @ stacked.b[2], atol=1e-4, rtol=1e-4
    )
    assert torch.equal(out[1], base[1]) and torch.equal(out[5], base[5])
    assert torch.equal(h[1], torch.zeros(rank))


@pytest.mark.parametrize(("num_heads", "num_kv"), [(4, 2), (4, 4), (8, 2)])
def test_paged_attention_reads_each_rows_blocks(interpret, num_heads: int, num_kv: int) -> None:
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv)
    head_dim, block = 16, 16
    cache = PagedKVCache(
        num_layers=1, num_blocks=12, block_size=block, num_kv_heads=num_kv, head_dim=head_dim,
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    cache.keys.normal_(generator=gen)
    cache.values.normal_(generator=gen)
    # Rows of 1, 16 (one full block), 17 and 40 tokens, on scattered blocks; row 4 holds nothing
    # (the scratch block, as an empty row of a decode batch) and must not disturb the others.
    tables = torch.tensor(
        [[3, 0, 0], [5, 0, 0], [1, 7, 0], [9, 2, 11], [0, 0, 0]], dtype=torch.int32
    )
    lengths = torch.tensor([1, 16, 17, 40, 1])
    q = torch.randn(5, num_heads, head_dim, generator=gen)
    got = triton_kernels.paged_decode_attention(
        q, cache.keys[0], cache.values[0], tables, lengths, 0.25, block
    )
    rows, bias = reference_layout(tables, lengths, block, None)
    want = paged_attention_reference(q, cache.keys[0], cache.values[0], rows, bias, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Row 0 sees one key: its output is that key's value, whatever the scores.
    group = num_heads // num_kv
    for head in range(num_heads):
        torch.testing.assert_close(got[0, head], cache.values[0][3 * block, head // group])


def test_generation_through_the_kernels_equals_the_torch_path(
    interpret, tiny_dir: Path, randomize: Callable[..., None], monkeypatch
) -> None:
    from services.model.loader import load_model
    from services.model.lora import MultiLoRA
    from services.model.paged_generate import PagedGenerator
    from services.model.sampling import SequenceSpec

    model, _ = load_model(tiny_dir)
    lora = MultiLoRA.attach(model, n_adapters=2, max_rank=8)
    randomize(lora, 0, 8, 16.0, seed=3, scale=0.3)
    randomize(lora, 1, 4, 4.0, seed=4, scale=0.3)
    specs = [
        SequenceSpec([1, 10, 11, 12], slot=0, max_tokens=4, seed=1),
        SequenceSpec([1, 20], slot=-1, max_tokens=3, seed=2),
        SequenceSpec([1, *range(30, 48)], slot=1, max_tokens=4, temperature=0.0),
    ]
    kernels = PagedGenerator(model, lora, eos_ids=[], max_seqs=4, cache_tokens=128)
    assert kernels.decoder.triton_attention
    got = kernels.generate(specs)
    monkeypatch.setattr(triton_kernels, "CPU_INTERPRETER", False)
    torch_path = PagedGenerator(model, lora, eos_ids=[], max_seqs=4, cache_tokens=128)
    assert not torch_path.decoder.triton_attention
    for a, b in zip(got, torch_path.generate(specs), strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
