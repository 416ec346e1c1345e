"""The decode path on a GPU: CUDA graphs, the Triton kernels compiled, bfloat16 (skipped without
CUDA; ``pytest -m gpu`` runs them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.model import triton_kernels
from services.model.loader import load_model
from services.model.lora import MultiLoRA
from services.model.lora_gather import StackedSlots, gathered_delta
from services.model.paged_generate import PagedGenerator
from services.model.sampling import SequenceSpec, generate_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[1, 10, 11, 12, 13], [1, 20], [1, *range(30, 47)], [1, 5, 6]]


def _model(tiny_dir: Path, randomize: Callable[..., None], dtype: torch.dtype) -> Any:
    model, _ = load_model(tiny_dir, device="cuda", dtype=dtype)
    lora = MultiLoRA.attach(model, n_adapters=3, max_rank=8)
    for idx, (rank, alpha) in enumerate([(8, 16.0), (4, 4.0), (2, 8.0)]):
        randomize(lora, idx, rank, alpha, seed=300 + idx, scale=0.3)
    return model, lora


def _specs(count: int) -> list[SequenceSpec]:
    return [
        SequenceSpec(
            PROMPTS[i % 4],
            slot=[0, 1, 2, -1][i % 4],
            max_tokens=6 + 5 * i,
            temperature=[1.0, 0.7, 0.0, 1.0][i % 4],
            top_p=[1.0, 1.0, 1.0, 0.8][i % 4],
            seed=i,
        )
        for i in range(count)
    ]


def test_captured_steps_sample_what_eager_steps_and_the_static_sampler_sample(
    tiny_dir, randomize
) -> None:
    model, lora = _model(tiny_dir, randomize, torch.float32)
    specs = _specs(12)  # through 8 rows: sequences join, leave, and the batch shrinks
    graphs = PagedGenerator(model, lora, eos_ids=[2], max_seqs=8, cache_tokens=1024)
    assert graphs.graphs.enabled and graphs.decoder.triton_attention
    captured = graphs.generate(specs)
    eager = PagedGenerator(
        model, lora, eos_ids=[2], max_seqs=8, cache_tokens=1024, cuda_graphs=False
    ).generate(specs)
    static = generate_batch(model, lora, specs, eos_ids=[2], pad_id=0)
    assert graphs.graphs.num_captures >= 2 and graphs.graphs.num_replays > 20
    for a, b, c in zip(captured, eager, static, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.logprobs == pytest.approx(c.logprobs, abs=1e-4)
    assert graphs.cache.allocator.num_free == graphs.cache.num_blocks - 1


def test_a_new_adapter_reaches_a_captured_step(tiny_dir, randomize) -> None:
    model, lora = _model(tiny_dir, randomize, torch.float32)
    spec = SequenceSpec(PROMPTS[0], slot=1, max_tokens=8, temperature=0.0)
    gen = PagedGenerator(model, lora, eos_ids=[], max_seqs=2, cache_tokens=256)
    (before,) = gen.generate([spec])
    replays = gen.graphs.num_replays
    lora.load_slot_state_dict(1, lora.slot_state_dict(0), rank=8, alpha=16.0)
    (after,) = gen.generate([spec])
    assert gen.graphs.num_replays > replays  # the same graphs, replayed with the new weights
    (expected,) = generate_batch(model, lora, [spec], eos_ids=[], pad_id=0)
    assert after.token_ids == expected.token_ids != before.token_ids


def test_bfloat16_logprobs_stay_within_its_rounding_of_the_trainers_forward(
    tiny_dir, randomize
) -> None:
    model, lora = _model(tiny_dir, randomize, torch.bfloat16)
    specs = [
        SequenceSpec(p, slot=s, max_tokens=24, seed=s + 9)
        for p, s in zip(PROMPTS, [0, 1, 2, -1], strict=True)
    ]
    gaps = []
    for spec, out in zip(
        specs, PagedGenerator(model, lora, eos_ids=[], max_seqs=4).generate(specs), strict=True
    ):
        ids = list(spec.prompt_ids) + out.token_ids
        with torch.inference_mode(), lora.use([spec.slot]):
            logits = model(input_ids=torch.tensor([ids], device="cuda")).logits[0].float()
        start = len(spec.prompt_ids) - 1
        rows = torch.log_softmax(logits, dim=-1)[start : start + len(out.token_ids)]
        picked = rows.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None]).squeeze(1)
        gaps.append((picked.cpu() - torch.tensor(out.logprobs)).abs())
    gap = torch.cat(gaps)
    assert gap.max() <= 0.05 and gap.mean() <= 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_compiled_lora_kernels_match_the_reference(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    n, rank, n_in, n_out = 4, 16, 2048, 8192
    stacked = StackedSlots(
        a=(0.02 * torch.randn(n, rank, n_in, generator=gen)).to("cuda", dtype),
        b=(0.02 * torch.randn(n, rank, n_out, generator=gen)).to("cuda", dtype),
    )
    slots = torch.tensor([3, -1, 0, 0, 1, 2, -1, 3] * 8, device="cuda")
    x = torch.randn(len(slots), n_in, generator=gen).to("cuda", dtype)
    base = torch.randn(len(slots), n_out, generator=gen).to("cuda", dtype)
    out = base.clone()
    triton_kernels.lora_expand(
        out, triton_kernels.lora_shrink(x, stacked.a, slots), stacked.b, slots
    )
    want = base.float() + gathered_delta(
        x.float(), StackedSlots(stacked.a.float(), stacked.b.float()), slots
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), want, atol=tol * want.abs().max().item(), rtol=tol)
    assert torch.equal(out[1], base[1])
