"""(c) of bench/trainer.py: 4 runs in one trainer process vs 4 single-run trainer processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import time
import zlib
from typing import Any

import torch
import trainer as bench
from trainer import COMPLETION, PROMPT, RANK, SEQ

from schemas.config import orch_config_from_dict
from schemas.events import RolloutBatch, Sample
from services.model.host import tune_allocator
from services.model.lora import MultiLoRA

Row = tuple[str, str, float, str]


def _batch(run_id: str, step: int, vocab: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{run_id}/{step}".encode()))
    samples = []
    for _ in range(16):
        ids = torch.randint(4, vocab, (SEQ,), generator=gen).tolist()
        samples.append(
            Sample(
                prompt_ids=ids[:PROMPT],
                completion_ids=ids[PROMPT:],
                completion_logprobs=[-4.4] * COMPLETION,
                reward=1.0,
                advantage=float(torch.randn(1, generator=gen)),
            )
        )
    return RolloutBatch(run_id=run_id, step=step, policy_version=step, samples=samples)


def trainer_worker(
    run_ids: list[str], steps: int, threads: int, device: str, dtype: str, queue: Any
) -> None:
    """One trainer process: its runs, ``steps`` steps each, all runs of a step trained together."""
    bench.DEVICE = DEVICE = torch.device(device)
    bench.DTYPE = getattr(torch, dtype)
    tune_allocator()
    torch.set_num_threads(threads)
    from services.trainer.state import create_run_state
    from services.trainer.step import StepExecutor

    model = bench.base_model()
    lora = MultiLoRA.attach(model, n_adapters=len(run_ids), max_rank=RANK)
    vocab = model.get_input_embeddings().num_embeddings
    executor = StepExecutor(
        model, lora, token_budget=8192, pad_id=0, vocab_size=vocab, device=DEVICE
    )
    config = orch_config_from_dict({"model": {"lora": {"rank": RANK, "alpha": 2.0 * RANK}}})
    states = {i: create_run_state(lora, i, r, config, "") for i, r in enumerate(run_ids)}
    batches = [[(i, _batch(r, s, vocab)) for i, r in enumerate(run_ids)] for s in range(steps + 1)]
    executor.run(batches[0], states)  # warm-up step, not timed
    bench._sync()
    start = time.time()
    for work in batches[1:]:
        executor.run(work, states)
    bench._sync()
    end = time.time()
    samples = steps * sum(len(b.samples) for _, b in batches[1])
    if DEVICE.type == "cuda":
        peak_mib = torch.cuda.max_memory_allocated(DEVICE) / 2**20
    else:
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put((start, end, samples, peak_mib))


def bench_trainers(steps: int, threads: int, DEVICE: torch.device, DTYPE: torch.dtype) -> list[Row]:
    ctx = mp.get_context("spawn")
    runs = [f"run_{i}" for i in range(4)]

    def launch(groups: list[list[str]], per_process_threads: int) -> tuple[float, float]:
        queue = ctx.Queue()
        procs = [
            ctx.Process(
                target=trainer_worker,
                args=(
                    g,
                    steps,
                    per_process_threads,
                    str(DEVICE),
                    str(DTYPE).removeprefix("torch."),
                    queue,
                ),
            )
            for g in groups
        ]
        for p in procs:
            p.start()
        results = [queue.get() for _ in procs]
        for p in procs:
            p.join()
        start = min(r[0] for r in results)
        end = max(r[1] for r in results)
        return sum(r[2] for r in results) / (end - start), sum(r[3] for r in results)

    shared_rate, shared_mem = launch([runs], threads)
    single_rate, single_mem = launch([[r] for r in runs], threads)
    memory = "peak GPU memory" if DEVICE.type == "cuda" else "peak RSS"
    rows: list[Row] = [
        (
            f"(c) 4 runs in one trainer: samples/s, {threads} thread(s) per process",
            f"{shared_rate:.1f}",
            shared_rate / single_rate,
            f"4 single-run trainers: {single_rate:.1f} samples/s; target >= 1.5x",
        ),
        (
            f"(c) 4 runs in one trainer: {memory} (MiB)",
            f"{shared_mem:.0f}",
            shared_mem / single_mem,
            f"4 single-run trainers: {single_mem:.0f} MiB in all; target <= 0.5x",
        ),
    ]
    cores = _cores()
    if DEVICE.type == "cpu" and cores > threads:
        # Each side given the whole machine as well as it can use it: the one trainer every
        # core, the four trainers a quarter of them each (at least one thread, never more
        # threads than cores in all, which OpenMP punishes).
        whole_rate, _ = launch([runs], cores)
        quarter = max(1, cores // 4)
        split_rate, _ = launch([[r] for r in runs], quarter)
        rows.append(
            (
                f"(c) 4 runs in one trainer with {cores} threads: samples/s",
                f"{whole_rate:.1f}",
                whole_rate / split_rate,
                f"4 single-run trainers with {quarter} thread(s) each: {split_rate:.1f} "
                "samples/s; target >= 1.5x",
            )
        )
    return rows


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
