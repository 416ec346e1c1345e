"""What one decode step of the engine costs the host: launches, synchronisations, time.

A PagedGenerator over a model of ``--shape`` (random weights) holds ``--runs`` x ``--seqs``
sequences, each run on its own random adapter; after warm-up steps, torch.profiler records
``--steps`` decode steps replayed from CUDA graphs and as many run eagerly (the same kernels
launched one by one). Printed per decode step:
kernel launches (``cudaLaunchKernel``, ``cuLaunchKernel``, ``cudaGraphLaunch``), host
synchronisations (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``,
synchronous ``cudaMemcpy``) and the median wall time.

    python bench/decode_profile.py --shape llama-1b --dtype bfloat16 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from shapes import NAMES, build_model
from torch.profiler import ProfilerActivity, profile

from services.model.lora import MultiLoRA
from services.model.paged_generate import PagedGenerator
from services.model.sampling import SequenceSpec

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaLaunchKernelExC")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def count(prof: Any, names: tuple[str, ...]) -> int:
    return sum(e.count for e in prof.key_averages() if e.key in names)


def measure(gen: PagedGenerator, steps: int, device: torch.device) -> tuple[float, int, int]:
    """(median seconds, launches, syncs) per decode step over ``steps`` steps."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    times = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            gen.step()
            times.append(time.perf_counter() - start)
    return statistics.median(times), count(prof, LAUNCHES) // steps, count(prof, SYNCS) // steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=NAMES, default="tiny")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=64, help="sequences per run")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    device = torch.device(args.device)
    model = build_model(args.shape, device, getattr(torch, args.dtype))
    lora = MultiLoRA.attach(model, n_adapters=args.runs, max_rank=8)
    for slot in range(args.runs):
        lora.reset_slot(slot, 8, 16.0, seed=slot)
    rows = args.runs * args.seqs
    specs = [
        SequenceSpec([1, *range(5, 5 + 8 + i % 8)], slot=i % args.runs, max_tokens=128, seed=i)
        for i in range(rows)
    ]
    print(f"{args.shape}, {args.dtype}, {device}, {args.runs} runs x {args.seqs} sequences")
    print("| decode step | launches | host syncs | median ms |")
    print("| --- | ---: | ---: | ---: |")
    for graphs in (True, False) if device.type == "cuda" else (False,):
        gen = PagedGenerator(
            model, lora, eos_ids=[], max_seqs=rows, cache_tokens=rows * 144, cuda_graphs=graphs
        )
        gen.add(specs)
        for _ in range(3):
            gen.step()  # warm-up: kernels compiled, the graph captured
        seconds, launches, syncs = measure(gen, args.steps, device)
        name = "paged, CUDA graph" if graphs else "paged, eager"
        print(f"| {name} | {launches} | {syncs} | {seconds * 1e3:.2f} |")
        gen.reset()
        del gen


if __name__ == "__main__":
    main()
