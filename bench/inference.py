"""Inference: mixed-run batching vs one adapter at a time, and how fast a new version is served.

1. Throughput. R runs (``--runs``, default 1, 4, 8), each with its own random LoRA adapter (rank
   8 on every projection), each asking for ``--prompts`` prompts (8-16 tokens) x ``--n``
   completions of exactly ``--max-tokens`` tokens (end-of-sequence is disabled everywhere so all
   generate the same number of tokens), sampling at temperature 1 over the full vocabulary, on a
   model of ``--shape`` (bench/shapes.py: random weights, no download) in ``--dtype``:

   - ``plexrl paged``: the torch engine as it runs (continuous batching over the paged KV cache,
     CUDA graphs on a GPU), every run's job submitted at once, each sequence on its own slot;
   - ``plexrl static``: the same engine with ``paged=False``: the static sampler it used before
     (Hugging Face forward, a ``DynamicCache`` grown by concatenation, host-side sampling);
   - ``HF+PEFT``: Hugging Face ``generate`` on a PeftModel holding the R adapters, one run after
     the other (``set_adapter``, then that run's sequences as one batch).

   Generated tokens per second, best of ``--repeats`` rounds that alternate between the three
   (after a warm-up round each), in the same process. The roofline (bench/shapes.py) is what the
   device's memory bandwidth allows a decode step that reads the weights, the adapters and the
   rows' cached keys and values once; the table gives the paged engine's fraction of it.

2. Swap latency. An embedded nats-server, one inference replica (torch engine) and a
   WeightPublisher (object store transport). For a ~1 MB and a ~50 MB adapter (a wider model,
   rank chosen to hit the size), each of ``--swaps`` new versions is published while a
   GenerateRequest with ``min_policy_version`` = that version waits; timestamps come from the
   replica (announcement received, adapter fetched, verified and staged, written into its slot)
   and from the reply. Medians.

    .venv/bin/python bench/inference.py [--max-tokens 64] [--repeats 3] [--swaps 5] [--threads 1]
    .venv/bin/python bench/inference.py --shape llama-1b --dtype bfloat16 --runs 1,8 \
        --prompts 8 --n 8 --max-tokens 128 --repeats 1 --skip-swap          # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from shapes import NAMES, roofline_for, write_model_dir

from schemas.events import (
    GenerateRequest,
    GenerateResponse,
    LoraSpec,
    RunDiscovered,
    WeightsReady,
)
from schemas.subjects import DISCOVERED, GENERATE
from services.bus import Bus, EmbeddedNats
from services.inference.jobs import Job
from services.inference.service import InferenceService
from services.inference.torch_engine import TorchEngine
from services.model.loader import load_model
from services.model.lora import DEFAULT_TARGET_MODULES, MultiLoRA, peft_key
from services.model.targets import find_targets, lora_dims
from services.model.tiny import TinySpec, build_tiny
from services.weights import WeightPublisher

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

TARGETS = list(DEFAULT_TARGET_MODULES)
RANK, ALPHA = 8, 16.0


def random_adapters(model_dir: Path, count: int, rank: int) -> list[dict[str, torch.Tensor]]:
    """``count`` PEFT-keyed adapters with random A and B (B non-zero, so each run differs).

    The layer names and sizes come from the model built on the meta device, so a model of any
    size costs no memory here. A is PEFT's kaiming-uniform, B normal with std 0.05.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    layers = [(name, lora_dims(module)) for name, module in find_targets(skeleton, TARGETS)]
    adapters = []
    for i in range(count):
        gen = torch.Generator().manual_seed(1000 + i)
        adapter = {}
        for name, dims in layers:
            assert dims is not None
            n_in, n_out = dims
            bound = 1.0 / n_in**0.5
            adapter[peft_key(name, "lora_A")] = (
                torch.rand(rank, n_in, generator=gen) * 2 - 1
            ) * bound
            adapter[peft_key(name, "lora_B")] = 0.05 * torch.randn(n_out, rank, generator=gen)
        adapters.append(adapter)
    return adapters


def prompts_for(run: int, count: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(run)
    lengths = torch.randint(8, 17, (count,), generator=gen).tolist()
    return [[1, *torch.randint(4, vocab, (n - 1,), generator=gen).tolist()] for n in lengths]


def event_for(run_id: str, idx: int, step: int, rank: int) -> WeightsReady:
    return WeightsReady(
        run_id=run_id,
        idx=idx,
        step=step,
        transport="object_store",
        location=f"{run_id}/step_{step}",
        digest="sha256:" + "0" * 64,
        size_bytes=1,
        lora=LoraSpec(rank=rank, alpha=ALPHA, target_modules=TARGETS),
    )


# --- 1. throughput ---------------------------------------------------------------------------


async def plexrl_engine(
    model_dir: Path,
    adapters: list[dict[str, torch.Tensor]],
    args: argparse.Namespace,
    *,
    paged: bool,
    max_tokens: int | None = None,
) -> tuple[TorchEngine, list[Job]]:
    """The torch engine holding one run per adapter, and each run's job."""
    runs = len(adapters)
    max_tokens = max_tokens or args.max_tokens
    sequences = runs * args.prompts * args.n
    engine = TorchEngine(
        model_dir,
        max_runs=runs,
        max_lora_rank=RANK,
        target_modules=TARGETS,
        device=args.device,
        dtype=DTYPES[args.dtype],
        max_batch_tokens=sequences * (16 + args.max_tokens),
        max_num_seqs=sequences,
        paged=paged,
    )
    await engine.start()
    engine.eos_ids = []  # fixed-length completions, as on the baseline side
    for idx, adapter in enumerate(adapters):
        engine.add_run(idx, f"run_{idx}", RANK, ALPHA)
        await engine.load_adapter(idx, event_for(f"run_{idx}", idx, 1, RANK), adapter)
    return engine, jobs_for(engine.vocab_size, runs, args, max_tokens)


def jobs_for(vocab: int, runs: int, args: argparse.Namespace, max_tokens: int) -> list[Job]:
    return [
        Job(
            request_id=f"bench-{idx}",
            run_id=f"run_{idx}",
            slot=idx,
            prompts=prompts_for(idx, args.prompts, vocab),
            n=args.n,
            max_tokens=max_tokens,
            temperature=1.0,
            top_p=1.0,
            min_version=1,
            seed=idx,
        )
        for idx in range(runs)
    ]


async def plexrl_round(engine: TorchEngine, jobs: list[Job]) -> tuple[int, float]:
    """Every run's job submitted at once (one batch): (tokens, seconds)."""
    _sync(engine.device)
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(job) for job in jobs))
    _sync(engine.device)
    return sum(r.num_tokens for r in results), time.perf_counter() - start


def peft_model(
    model_dir: Path, adapters: list[dict[str, torch.Tensor]], device: str, dtype: torch.dtype
) -> Any:
    """A PeftModel holding every adapter, named run_<i>."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    base, _ = load_model(model_dir, device=device, dtype=dtype)
    config = LoraConfig(r=RANK, lora_alpha=int(ALPHA), target_modules=TARGETS, lora_dropout=0.0)
    model: Any = get_peft_model(base, config, adapter_name="run_0")
    for idx, adapter in enumerate(adapters):
        if idx:
            model.add_adapter(f"run_{idx}", config)
        set_peft_model_state_dict(model, adapter, adapter_name=f"run_{idx}")
    return model.to(device, dtype).eval()


def peft_round(model: Any, jobs: list[Job], max_tokens: int) -> tuple[int, float]:
    """One run after the other: set_adapter, then HF generate on that run's sequences."""
    device = next(model.parameters()).device
    _sync(device)
    start = time.perf_counter()
    tokens = 0
    for idx, job in enumerate(jobs):
        prompts = [p for p in job.prompts for _ in range(job.n)]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        model.set_adapter(f"run_{idx}")
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=0,
            )
        tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    _sync(device)
    return tokens, time.perf_counter() - start


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


async def throughput(model_dir: Path, args: argparse.Namespace) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    line = roofline_for(config, DTYPES[args.dtype], torch.device(args.device))
    print(
        f"\n### Generated tokens/s, {args.shape} ({args.dtype}), {args.prompts} prompts x "
        f"{args.n} completions x {args.max_tokens} tokens per run, rank {RANK}, "
        f"{torch.get_num_threads()} threads, best of {args.repeats} interleaved rounds; "
        f"roofline at {line.bandwidth_source}\n"
    )
    print(
        "| runs | sequences | plexrl paged | plexrl static (before) | HF+PEFT per adapter | "
        "paged / HF+PEFT | paged / static | roofline | paged / roofline |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for runs in args.runs:
        adapters = random_adapters(model_dir, runs, RANK)
        paged, jobs = await plexrl_engine(model_dir, adapters, args, paged=True)
        static, _ = await plexrl_engine(model_dir, adapters, args, paged=False)
        model = peft_model(model_dir, adapters, args.device, DTYPES[args.dtype])
        # Warm-up: the engines at full size (graphs captured, buffers sized), HF+PEFT briefly.
        await plexrl_round(paged, jobs)
        await plexrl_round(static, jobs)
        peft_round(model, jobs_for(paged.vocab_size, runs, args, 4), 4)
        best = {"paged": 0.0, "static": 0.0, "peft": 0.0}
        # Alternating rounds share whatever else the machine is doing.
        for _ in range(args.repeats):
            for name, engine in (("paged", paged), ("static", static)):
                tokens, seconds = await plexrl_round(engine, jobs)
                best[name] = max(best[name], tokens / seconds)
            tokens, seconds = peft_round(model, jobs, args.max_tokens)
            best["peft"] = max(best["peft"], tokens / seconds)
        await paged.close()
        await static.close()
        del model, paged, static
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
        sequences = runs * args.prompts * args.n
        adapter_bytes = runs * sum(
            t.numel() * DTYPES[args.dtype].itemsize for t in adapters[0].values()
        )
        roof = line.tokens_per_s(sequences, 12.5 + (args.max_tokens + 1) / 2, adapter_bytes)
        print(
            f"| {runs} | {sequences} | {best['paged']:,.0f} | {best['static']:,.0f} | "
            f"{best['peft']:,.0f} | {best['paged'] / best['peft']:.2f}x | "
            f"{best['paged'] / best['static']:.2f}x | {roof:,.0f} | "
            f"{100 * best['paged'] / roof:.1f}% |"
        )


# --- 2. swap latency -------------------------------------------------------------------------


async def swap_latency(args: argparse.Namespace, workdir: Path) -> None:
    spec = TinySpec(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1536,
    )
    model_dir = build_tiny(workdir / "wide", spec=spec).path
    model, _ = load_model(model_dir)
    probe = MultiLoRA.attach(model, n_adapters=1, max_rank=1, target_modules=TARGETS)
    bytes_per_rank = sum(4 * (m.in_features + m.out_features) for m in probe.layers.values())
    sizes = {"1 MB": 1 << 20, "50 MB": 50 << 20}
    ranks = {name: max(1, round(size / bytes_per_rank)) for name, size in sizes.items()}
    print(
        f"\n### WeightsReady -> new version served (hidden 512 x 8 layers, object store, "
        f"median of {args.swaps})\n"
    )
    print(
        "| adapter | rank | publish() (store + announce) | received -> fetched, verified, "
        "staged | staged -> in slot | received -> served | publish() start -> served | target |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with EmbeddedNats(store_dir=workdir / "nats") as server:
        for idx, rank in enumerate(ranks.values()):
            adapters = random_adapters(model_dir, args.swaps, rank)
            run_id = f"run_swap{idx}"
            rows = await _swaps(server.url, model_dir, run_id, rank, adapters, workdir)
            size = sum(t.numel() * t.element_size() for t in adapters[0].values()) / 2**20
            target = "< 100 ms" if idx == 0 else "< 1 s"
            cells = [f"{statistics.median(col) * 1000:,.1f} ms" for col in zip(*rows, strict=True)]
            print(f"| {size:.1f} MB | {rank} | " + " | ".join(cells) + f" | {target} |")


async def _swaps(
    url: str,
    model_dir: Path,
    run_id: str,
    rank: int,
    adapters: list[dict[str, torch.Tensor]],
    workdir: Path,
) -> list[tuple[float, ...]]:
    bus = await Bus.connect(url, "inference")
    client = await Bus.connect(url, "bench")
    engine = TorchEngine(model_dir, max_runs=1, max_lora_rank=rank, target_modules=TARGETS)
    service = InferenceService(bus, engine, max_runs=1, replica_name="bench", output_dir=workdir)
    await service.start()
    config = {"model": {"lora": {"rank": rank, "alpha": ALPHA}}}
    await client.publish(DISCOVERED, RunDiscovered(run_id=run_id, idx=0, config=config))
    publisher = WeightPublisher(client, workdir / "weights")
    lora = LoraSpec(rank=rank, alpha=ALPHA, target_modules=TARGETS)
    rows: list[tuple[float, ...]] = []
    for step, adapter in enumerate(adapters, start=1):
        req = GenerateRequest(
            request_id=f"{run_id}-{step}",
            run_id=run_id,
            prompts=[[1, 5, 6]],
            max_tokens=1,
            min_policy_version=step,
            timeout_s=60,
        )
        asked = asyncio.create_task(client.request(GENERATE, req, GenerateResponse, timeout=60))
        await asyncio.sleep(0.05)  # the request is waiting before the version exists
        start = time.monotonic()
        await publisher.publish(run_id, 0, step, adapter, lora)
        published = time.monotonic()
        resp = await asked
        served = time.monotonic()
        assert resp.error is None and resp.policy_version == step, resp.error
        received = service.follower.received_at[(run_id, step)]
        staged = service.installed_at[(run_id, step)]
        applied = next(
            a.applied_at
            for a in engine.applied
            if (a.state.run_id, a.state.version) == (run_id, step)
        )
        rows.append(
            (
                published - start,
                staged - received,
                applied - staged,
                served - received,
                served - start,
            )
        )
    await service.stop()
    await bus.close()
    await client.close()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per run")
    parser.add_argument("--n", type=int, default=2, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--swaps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: default)")
    parser.add_argument("--shape", choices=NAMES, default="tiny", help="model shape")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--device", default="", help="cpu or cuda (default: cuda if present)")
    parser.add_argument(
        "--runs",
        type=lambda v: [int(r) for r in v.split(",")],
        default=[1, 4, 8],
        help="comma-separated run counts (default 1,4,8)",
    )
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-swap", action="store_true")
    args = parser.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        # One thread by default: on a shared machine, several threads per op wait on each
        # other whenever another process takes a core, which swamps what is being measured.
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="plexrl-bench-") as tmp:
        workdir = Path(tmp)
        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, device {args.device}")
        if not args.skip_throughput:
            if args.shape == "tiny":
                model_dir = build_tiny(workdir / "tiny").path
            else:
                device = torch.device(args.device)
                model_dir = write_model_dir(
                    args.shape, workdir / args.shape, device, DTYPES[args.dtype]
                )
            await throughput(model_dir, args)
        if not args.skip_swap:
            await swap_latency(args, workdir)


if __name__ == "__main__":
    asyncio.run(main())
