"""The vllm engine keeps the torch engine's contract. Its generation tests need vllm and a GPU
and are skipped, with the reason, anywhere else; the refusal without them runs everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inference_support import lora_spec, random_adapter

from schemas.events import WeightsReady
from services.cli import main
from services.inference.jobs import Job
from services.inference.vllm_engine import VllmEngine, vllm_unavailable_reason

REASON = vllm_unavailable_reason()


def test_the_cli_refuses_the_vllm_engine_where_it_cannot_run(tiny_dir: Path, capsys) -> None:
    if not REASON:
        pytest.skip("vllm can run here, so there is no refusal to check")
    assert main(["inference", "--engine", "vllm", "--model", str(tiny_dir)]) == 3
    err = capsys.readouterr().err
    assert REASON in err and "--engine torch" in err


def _reference_logprobs(model, lora, slot: int, prompt: list[int], tokens: list[int]) -> list:
    with torch.inference_mode(), lora.use([slot]):
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(bool(REASON), reason=REASON or "runs")
async def test_vllm_serves_each_version_with_the_sampled_tokens_logprobs(
    tiny_dir: Path, tmp_path: Path, scratch_lora
) -> None:
    model, lora = scratch_lora
    engine = VllmEngine(
        tiny_dir,
        max_runs=2,
        max_lora_rank=8,
        output_dir=tmp_path,
        replica_name="gpu-test",
        gpu_memory_utilization=0.3,
        dtype="float32",
    )
    await engine.start()
    try:
        engine.add_run(0, "run_vllm", 4, 8.0)
        prompt = [1, 10, 11, 12]
        job = Job(
            request_id="v",
            run_id="run_vllm",
            slot=0,
            prompts=[prompt],
            n=2,
            max_tokens=8,
            temperature=1.0,
            top_p=1.0,
            min_version=0,
            seed=3,
        )
        base = await engine.generate(job)
        assert base.policy_version == 0
        for completion in base.completions[0]:
            expected = _reference_logprobs(model, lora, -1, prompt, completion.token_ids)
            assert completion.logprobs == pytest.approx(expected, abs=2e-3)
        assert (await engine.generate(job)).completions == base.completions  # seeded
        adapter = random_adapter(lora, 0, 4, 8.0, seed=71)
        event = WeightsReady(
            run_id="run_vllm",
            idx=0,
            step=1,
            transport="object_store",
            location="run_vllm/step_1",
            digest="sha256:" + "0" * 64,
            size_bytes=1,
            lora=lora_spec(),
        )
        assert await engine.load_adapter(0, event, adapter)
        assert engine.available_version(0, "run_vllm") == 1
        tuned = await engine.generate(job)
        assert tuned.policy_version == 1
        for completion in tuned.completions[0]:
            expected = _reference_logprobs(model, lora, 0, prompt, completion.token_ids)
            assert completion.logprobs == pytest.approx(expected, abs=2e-3)
    finally:
        await engine.close()
