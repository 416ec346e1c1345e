"""Sharded trainer ranks (FSDP2) against data-parallel ranks, the same ranks and the same steps.

Model: the trainer bench's Llama (hidden 256, 4 layers, 8 heads, 4 KV heads, MLP 768, the tiny
model's vocabulary), written to a temporary model directory and loaded from it as the trainer
loads it (a sharded layout straight into its shards); LoRA rank 16 on every projection, one slot
per run.
Work: ``--runs`` runs (8) x ``--samples`` (16) x 128 tokens per step, micro-batches of 2,048 tokens, every
run trained every step, through the trainer's own StepExecutor and run states.

Three layouts on ``--ranks`` ranks (2; gloo on the CPU, NCCL with ``--device cuda``), each in
fresh processes:

- ``dp``: every rank the whole model and every slot (the trainer's default);
- ``fsdp``: the trainer's ``--sharding fsdp``: each block's base weights and LoRA slots sharded;
- ``fsdp-replicated-slots``: the base sharded the same way but the slots left whole on every rank
  (outside FSDP) and their gradients all-reduced as ``dp`` does: the alternative to ``fsdp``.

Per rank: the bytes of base-model parameters it holds, of adapter state it holds (slot
parameters and each run's AdamW moments), rank 0's host copy of every run's adapter and moments
(what a sharded trainer publishes and checkpoints from), and the peak memory over the steps (on
the CPU the resident size's growth from just before loading; on a GPU the memory allocated, and
also what is allocated once the model is loaded). Samples/s over
``--steps`` steps after one warm-up step. Ratios are against ``dp`` in the same invocation.

    .venv/bin/python bench/sharding.py [--ranks 2] [--steps 3] [--runs 8] [--samples 16]
        [--threads 1] [--hidden 256 --layers 4] [--device cuda]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from schemas.config import orch_config_from_dict
from schemas.events import RolloutBatch, Sample
from services.model.host import tune_allocator
from services.model.tiny import TinySpec, tiny_config

LAYOUTS = ("dp", "fsdp", "fsdp-replicated-slots")
RANK, PROMPT, COMPLETION = 16, 32, 96
MICRO_BATCH_TOKENS = 2048


def _batch(run_id: str, step: int, vocab: int, num_samples: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{run_id}/{step}".encode()))
    samples = []
    for _ in range(num_samples):
        ids = torch.randint(4, vocab, (PROMPT + COMPLETION,), generator=gen).tolist()
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


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _held(tensors: Any) -> int:
    """Bytes of ``tensors`` this rank holds (its shard of a DTensor)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def rank_worker(rank: int, world: int, port: int, layout: str, args: Any, queue: Any) -> None:
    """One rank: build the layout, train a warm-up step and ``args.steps`` timed steps."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    tune_allocator()
    torch.set_num_threads(args.threads)
    import torch.distributed as dist
    import transformers  # noqa: F401 - imported before the memory baseline

    from services.trainer.distributed import close_ranks, init_ranks
    from services.trainer.service import build_model
    from services.trainer.settings import TrainerSettings
    from services.trainer.sharded_load import load_sharded
    from services.trainer.sharding import ShardedAdamW, ShardedLoRA
    from services.trainer.state import create_run_state
    from services.trainer.step import StepExecutor

    ranks = init_ranks(args.device, "dp" if layout == "dp" else "fsdp")
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    settings = TrainerSettings(
        model=args.model_dir,
        max_runs=args.runs,
        max_lora_rank=RANK,
        sharding="dp" if layout == "dp" else "fsdp",
    )
    rss_before = _rss()
    model: Any
    lora: Any
    if layout == "fsdp-replicated-slots":
        model, lora, _ = load_sharded(settings, device, ranks, shard_slots=False)
    else:
        model, lora, _, _ = build_model(settings, device, ranks)
    loaded = torch.cuda.memory_allocated(device) if device.type == "cuda" else _rss() - rss_before
    vocab = model.get_input_embeddings().num_embeddings
    config = orch_config_from_dict({"model": {"lora": {"rank": RANK, "alpha": 2.0 * RANK}}})
    run_ids = [f"run_{i}" for i in range(args.runs)]
    states = {i: create_run_state(lora, i, r, config, "") for i, r in enumerate(run_ids)}
    executor = StepExecutor(
        model,
        lora,
        token_budget=MICRO_BATCH_TOKENS,
        pad_id=0,
        vocab_size=vocab,
        device=device,
        ranks=ranks,
    )
    work = [
        [(i, _batch(r, s, vocab, args.samples)) for i, r in enumerate(run_ids)]
        for s in range(args.steps + 1)
    ]
    executor.run(work[0], states)  # warm-up, not timed
    dist.barrier()
    start = time.perf_counter()
    update_ns = 0
    for step in work[1:]:
        report = executor.run(step, states)
        begin, end = report.phases["optimizer"]
        update_ns += end - begin
    dist.barrier()
    seconds = time.perf_counter() - start

    slot_params = {id(p) for i in range(args.runs) for p in lora.slot_parameters(i)}
    base = [p for p in model.parameters() if id(p) not in slot_params]
    slots = [p for i in range(args.runs) for p in lora.slot_parameters(i)]
    moments = [
        v
        for s in states.values()
        for entry in s.optimizer.state.values()
        for name, v in entry.items()
        if name != "step"
    ]
    host = 0
    if isinstance(lora, ShardedLoRA) and ranks.is_main:
        host = sum(_held(lora.slot_state_dict(i).values()) for i in states)
        for s in states.values():
            assert isinstance(s.optimizer, ShardedAdamW)
            for entry in s.optimizer.state_dict()["state"].values():
                host += _held(v for n, v in entry.items() if n != "step")
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    queue.put(
        {
            "rank": rank,
            "base": _held(base),
            "slots": _held(slots) + _held(moments),
            "host": host,
            "loaded": loaded,
            "peak": peak,
            "samples_per_s": args.steps * args.runs * args.samples / seconds,
            "update_share": update_ns / 1e9 / seconds,
        }
    )
    close_ranks(ranks)


def write_model(args: Any) -> None:
    """The bench's base model as a model directory, which every layout loads as the trainer
    does (a sharded one straight into its shards)."""
    import shutil

    from transformers import LlamaForCausalLM

    from services.model.tiny import build_tiny_model

    tiny = build_tiny_model(args.model_dir / "tiny", seed=0)
    spec = TinySpec(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=3 * args.hidden,
        max_position_embeddings=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: Any = LlamaForCausalLM(tiny_config(spec))
    model.save_pretrained(args.model_dir)
    for f in tiny.iterdir():
        if f.name not in {"config.json", "model.safetensors", "generation_config.json"}:
            shutil.copy(f, args.model_dir / f.name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_layout(layout: str, args: Any) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=rank_worker, args=(r, args.ranks, port, layout, args, queue))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"{layout}: a rank exited with status {p.exitcode}")
    return sorted(results, key=lambda r: r["rank"])


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=16, help="samples per run and step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = Path(tmp) / "model"
        write_model(args)
        results = {layout: run_layout(layout, args) for layout in layouts}
    base = results.get("dp")
    peak_name = "peak GPU memory" if args.device == "cuda" else "peak RSS growth"
    print(
        f"\n{args.ranks} ranks, {args.runs} runs x {args.samples} x {PROMPT + COMPLETION} tokens, "
        f"Llama hidden {args.hidden} x {args.layers} layers, LoRA rank {RANK}, {args.device}\n"
    )
    print("| per rank | " + " | ".join(layouts) + " |")
    print("| --- |" + " ---: |" * len(layouts))
    rows = [
        ("base-model parameters held", "base", max),
        ("adapter state held (slots + AdamW moments)", "slots", max),
        ("rank 0's host copy of adapters + moments", "host", max),
        (f"{peak_name} (the largest rank)", "peak", max),
    ]
    if args.device == "cuda":
        # (on the CPU the resident size says little here: an ordinary load maps the weights
        # file and pages it in only as it is read)
        rows.insert(3, ("GPU memory once loaded", "loaded", max))
    for label, key, pick in rows:
        cells = []
        for layout in layouts:
            value = pick(r[key] for r in results[layout])
            ref = pick(r[key] for r in base) if base else 0
            ratio = f" ({value / ref:.2f}x)" if ref else ""
            cells.append(_mib(value) + ratio)
        print(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for layout in layouts:
        rate = min(r["samples_per_s"] for r in results[layout])
        ref = min(r["samples_per_s"] for r in base) if base else 0
        cells.append(f"{rate:.1f}" + (f" ({rate / ref:.2f}x)" if ref else ""))
    print("| samples/s | " + " | ".join(cells) + " |")
    shares = [f"{max(r['update_share'] for r in results[layout]):.0%}" for layout in layouts]
    print(
        "| share of step time in the update (all-reduce, AdamW, gathers) | "
        + " | ".join(shares)
        + " |"
    )


if __name__ == "__main__":
    main()
