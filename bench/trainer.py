"""Multi-run trainer vs its baselines, measured in the same run on the same samples.

Model: a Llama built in-process (no download): hidden 256, 4 layers, 8 heads (4 KV heads),
MLP 768, the tiny model's character vocabulary; LoRA rank 16 on every attention and MLP
projection. Samples: 8 runs x 4 sequences x 128 tokens (32 prompt + 96 completion).

(a) multi-adapter: one forward+backward with the 8 runs' rows mixed in one batch (grouped by
    run, as the trainer orders a micro-batch), each row routed to its run's adapter slot, vs
    PEFT switching adapters: 8 forward+backward passes, one per adapter (``set_adapter``),
    each on that run's rows. Also at 1 x 64 tokens per run, where per-pass overheads count.
(b) overhead: the same mixed multi-adapter forward+backward vs the bare base model
    forward+backward on the same batch (no LoRA; gradients flow back to the input embeddings,
    the activation-gradient work that LoRA training needs as well); and one MultiLoRALinear
    (8 slots) vs one nn.Linear on 4096 tokens.
(c) trainer: 4 runs in one trainer process (one StepExecutor, 4 slots) vs 4 single-run trainer
    processes side by side, each training its own run on the same batches, every process with
    the same thread count (as four trainers started with the same settings would be); samples
    per second over the training steps, and peak RSS (summed over the 4 processes; peak GPU
    memory on a GPU). On a CPU with more cores than ``--threads``, also each side given the
    whole machine: the one trainer a thread per core, the four trainers a quarter each.

(d) model families, with ``--families all`` (or a comma-separated list of
    services/model/families.py's names): (b)'s ratio for each family's architecture at the same
    shape (hidden 256, 4 layers, MLP 768; a mixture of experts: 4 experts, 2 per token, each
    384 wide), LoRA on the family's default targets. ``--families-only`` skips (a) to (c).

(e) model shapes, with ``--shape`` (bench/shapes.py: ``tiny``, ``llama-1b``, ``llama-8b``,
    ``qwen2.5-0.5b``, random weights from the config, no download): (a) and (b) alone, on that
    model, at the shape's two batches (:data:`SHAPE_BATCHES`: a large one and 8 runs x 1 x 128
    tokens, where per-pass overheads count); ``--rows-per-run`` overrides the large batch's rows
    (a GPU with less memory). The three models share one copy of the base weights.

In (c) every run's batch holds 16 samples of 128 tokens. Each timing is the median of
``--repeats`` after a warm-up, the functions compared taking turns in every round so that a
machine shared with other work slows them alike. CPU by default, ``--device cuda`` on a GPU.
Prints a markdown table.

Where the gains come from. The multi-adapter pass does the same arithmetic as the adapter-by-
adapter passes; what it saves is everything paid per pass (the base model's launches, PEFT's
per-layer dispatch) and, on a GPU, the idle units of small per-run batches. On a CPU, whose
cores are as busy with a 512-token pass as with a 4,096-token one, (a) and the samples/s of (c)
therefore sit near 1x once a run's share of the batch is large; they grow as it shrinks.

    .venv/bin/python bench/trainer.py [--repeats 5] [--threads N] [--steps 6] [--device cuda]
        [--dtype bfloat16]
        [--families all [--families-only]]
    .venv/bin/python bench/trainer.py --shape llama-1b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from shapes import NAMES as SHAPE_NAMES
from shapes import build_model

from services.model.families import FAMILIES, FamilyShape, tiny_family_model
from services.model.host import tune_allocator
from services.model.lora import DEFAULT_TARGET_MODULES, MultiLoRA, MultiLoRALinear
from services.model.tiny import TinySpec, tiny_config
from services.trainer.loss import selected_logprobs
from services.trainer.settings import default_threads

SPEC = TinySpec(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=768,
    max_position_embeddings=256,
)
RUNS, ROWS_PER_RUN, PROMPT, COMPLETION, RANK = 8, 4, 32, 96, 16
SEQ = PROMPT + COMPLETION


SHAPE_BATCHES = {
    "tiny": ((4, 128, 32), (1, 64, 16)),
    "llama-1b": ((4, 512, 128), (1, 128, 32)),
    "llama-8b": ((2, 512, 128), (1, 128, 32)),
    "qwen2.5-0.5b": ((4, 512, 128), (1, 128, 32)),
}
"""(rows per run, tokens per row, prompt tokens) of (e)'s two batches, 8 runs each"""

SHAPE: str | None = None
"""``--shape``: the model (a)-(b) run on instead of the built-in one."""
DEVICE = torch.device("cpu")
"""Where (a), (b) and (c) run; ``--device cuda`` measures on a GPU."""
DTYPE = torch.float32
"""The models' parameter dtype; ``--dtype bfloat16`` as the trainer's ``dtype`` setting."""


def base_model() -> Any:
    from transformers import LlamaForCausalLM

    if SHAPE is not None:
        return build_model(SHAPE, DEVICE, DTYPE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: Any = LlamaForCausalLM(tiny_config(SPEC))
    return model.to(DEVICE, DTYPE).eval()


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def median_times(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, the functions taking turns in every round so that a
    change in the machine's load (it may be shared) hits them alike."""
    for fn in fns.values():
        fn()  # warm-up: kernels, allocator, thread pools
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def token_mean_loss(logits: torch.Tensor, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """The trainer's shape of loss: mean log-probability of the completion tokens."""
    lp = selected_logprobs(logits[:, prompt - 1 : -1], ids[:, prompt:])
    return -lp.mean()


# --- (a) and (b): one forward+backward -----------------------------------------------------------


Row = tuple[str, str, float, str]
"""measurement, value as shown, ratio to the baseline, the baseline and the target"""


def bench_forward_backward(repeats: int, rows_per_run: int, seq: int, prompt: int) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    multi = base_model()
    vocab = multi.config.vocab_size
    ids = torch.randint(4, vocab, (RUNS * rows_per_run, seq), generator=gen).to(DEVICE)
    # rows grouped by run, as the trainer's executor orders each micro-batch
    slots = torch.arange(RUNS).repeat_interleave(rows_per_run).to(DEVICE)
    # PEFT and the bare model share these weights: one copy of an 8B model, not three
    weights = multi.state_dict(keep_vars=True)
    lora = MultiLoRA.attach(multi, n_adapters=RUNS, max_rank=RANK)
    for s in range(RUNS):
        lora.reset_slot(s, RANK, 2.0 * RANK, seed=s)
        with torch.no_grad():  # non-zero B, so that A gets gradients too
            for layer in lora.layers.values():
                layer.lora_B[s].copy_(
                    torch.randn(layer.lora_B[s].shape, generator=gen.manual_seed(s)) * 0.02
                )

    def multi_step() -> None:
        with lora.use(slots):
            token_mean_loss(multi(input_ids=ids).logits, ids, prompt).backward()
        for s in range(RUNS):
            for p in lora.slot_parameters(s):
                p.grad = None

    peft_model = _peft_model(lora, sharing(multi, weights))

    def peft_step() -> None:
        for s in range(RUNS):
            rows = slots == s
            peft_model.set_adapter(f"run{s}")
            logits = peft_model(input_ids=ids[rows]).logits
            token_mean_loss(logits, ids[rows], prompt).backward()
        peft_model.zero_grad(set_to_none=True)

    bare = sharing(multi, weights).requires_grad_(False)
    embed = bare.get_input_embeddings()

    def bare_step() -> None:
        x = embed(ids).detach().requires_grad_(True)
        token_mean_loss(bare(inputs_embeds=x).logits, ids, prompt).backward()

    t = median_times({"multi": multi_step, "peft": peft_step, "bare": bare_step}, repeats)
    t_multi, t_peft, t_bare = t["multi"], t["peft"], t["bare"]
    shape = f"8 runs x {rows_per_run} x {seq} tokens"
    return [
        (
            f"(a) multi-adapter fwd+bwd, {shape}",
            f"{t_multi * 1e3:.1f} ms",
            t_peft / t_multi,
            f"PEFT, 8 passes switching adapters: {t_peft * 1e3:.1f} ms; target >= 3x",
        ),
        (
            f"(b) multi-adapter over bare model fwd+bwd, {shape}",
            f"{t_multi * 1e3:.1f} ms",
            t_multi / t_bare,
            f"bare base model: {t_bare * 1e3:.1f} ms; target <= 1.3x",
        ),
    ]


def bench_families(repeats: int, families: list[str]) -> list[Row]:
    """(b)'s ratio, multi-adapter over bare base forward+backward, for each family."""
    vocab = tiny_config(SPEC).vocab_size
    shape = FamilyShape(
        vocab_size=vocab,
        hidden_size=SPEC.hidden_size,
        intermediate_size=SPEC.intermediate_size,
        num_hidden_layers=SPEC.num_hidden_layers,
        num_attention_heads=SPEC.num_attention_heads,
        num_key_value_heads=SPEC.num_key_value_heads,
        max_position_embeddings=SPEC.max_position_embeddings,
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (RUNS * ROWS_PER_RUN, SEQ), generator=gen).to(DEVICE)
    slots = torch.arange(RUNS).repeat_interleave(ROWS_PER_RUN).to(DEVICE)
    rows: list[Row] = []
    for family in families:
        multi = tiny_family_model(family, seed=0, shape=shape).to(DEVICE, DTYPE)
        bare = copy.deepcopy(multi).requires_grad_(False)
        lora = MultiLoRA.attach(multi, n_adapters=RUNS, max_rank=RANK)
        for s in range(RUNS):
            lora.reset_slot(s, RANK, 2.0 * RANK, seed=s)
            with torch.no_grad():
                for layer in lora.layers.values():
                    layer.lora_B[s].copy_(
                        torch.randn(layer.lora_B[s].shape, generator=gen.manual_seed(s)) * 0.02
                    )
        embed = bare.get_input_embeddings()

        def multi_step(model: Any = multi, lora: MultiLoRA = lora) -> None:
            with lora.use(slots):
                token_mean_loss(model(input_ids=ids).logits, ids, PROMPT).backward()
            for s in range(RUNS):
                for p in lora.slot_parameters(s):
                    p.grad = None

        def bare_step(model: Any = bare, embed: Any = embed) -> None:
            x = embed(ids).detach().requires_grad_(True)
            token_mean_loss(model(inputs_embeds=x).logits, ids, PROMPT).backward()

        t = median_times({"multi": multi_step, "bare": bare_step}, repeats)
        targets = ", ".join(lora.target_modules)
        rows.append(
            (
                f"(d) {family} ({multi.config.model_type}): multi-adapter over bare fwd+bwd, "
                f"LoRA on {targets}",
                f"{t['multi'] * 1e3:.1f} ms",
                t["multi"] / t["bare"],
                f"bare base model: {t['bare'] * 1e3:.1f} ms; target <= 1.3x",
            )
        )
    return rows


def bench_layer(repeats: int) -> list[Row]:
    t_layer, t_linear = _layer_times(repeats)
    return [
        (
            "(b) one MultiLoRALinear 256->768, 8 slots, 4096 tokens",
            f"{t_layer * 1e3:.2f} ms",
            t_layer / t_linear,
            f"nn.Linear: {t_linear * 1e3:.2f} ms",
        )
    ]


def sharing(source: Any, weights: dict[str, torch.Tensor]) -> Any:
    """A second model of ``source``'s architecture holding the very tensors of ``weights`` (its
    state dict before LoRA was attached): no copy. Buffers outside the state dict (the rotary
    frequencies) are taken from ``source``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(source.config, dtype=DTYPE)
    model.load_state_dict(weights, assign=True)
    sources = dict(source.named_buffers())
    for name, buffer in list(model.named_buffers()):
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, sources[name], persistent=False)
    return model.eval()


def _peft_model(lora: MultiLoRA, base: Any) -> Any:
    """``base`` (the same weights) under PEFT, with the same 8 adapters loaded by name."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    config = LoraConfig(
        r=RANK,
        lora_alpha=2 * RANK,
        target_modules=list(DEFAULT_TARGET_MODULES),
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    model = get_peft_model(base, config, adapter_name="run0")
    for s in range(RUNS):
        if s:
            model.add_adapter(f"run{s}", config)
        set_peft_model_state_dict(model, lora.slot_state_dict(s), adapter_name=f"run{s}")
    return model.to(DEVICE, DTYPE)


def _layer_times(repeats: int) -> tuple[float, float]:
    tokens = RUNS * ROWS_PER_RUN * SEQ
    linear = torch.nn.Linear(SPEC.hidden_size, SPEC.intermediate_size, bias=False)
    linear = linear.to(DEVICE, DTYPE)
    layer = MultiLoRALinear(copy.deepcopy(linear), RUNS, RANK)
    with torch.no_grad():
        for s in range(RUNS):
            layer.lora_A[s].normal_(0, 0.02)
            layer.lora_B[s].normal_(0, 0.02)
    slots = torch.arange(RUNS).repeat_interleave(tokens // RUNS).to(DEVICE)
    layer.adapter_context.set_slot_ids(slots)
    linear.requires_grad_(False)
    x = torch.randn(tokens, SPEC.hidden_size, device=DEVICE, dtype=DTYPE)

    def multi() -> None:
        xi = x.detach().requires_grad_(True)
        layer(xi).square().mean().backward()
        layer.zero_grad(set_to_none=True)

    def plain() -> None:
        xi = x.detach().requires_grad_(True)
        linear(xi).square().mean().backward()

    t = median_times({"multi": multi, "plain": plain}, repeats)
    return t["multi"], t["plain"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed trainer steps in (c)")
    parser.add_argument(
        "--threads",
        type=int,
        default=default_threads(),
        help="torch threads of every process (default: the trainer's, half the cores)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda to measure on a GPU")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the models' dtype (bfloat16 takes torch._grouped_mm on a Hopper-class GPU)",
    )
    parser.add_argument(
        "--families",
        default="",
        help="(d): 'all' or a comma-separated list of " + ", ".join(FAMILIES) + " (default: none)",
    )
    parser.add_argument("--families-only", action="store_true", help="run (d) alone")
    parser.add_argument(
        "--shape", choices=SHAPE_NAMES, default=None, help="(e): (a) and (b) on this model alone"
    )
    parser.add_argument(
        "--rows-per-run", type=int, default=0, help="(e): rows per run of the large batch"
    )
    args = parser.parse_args()
    families = (
        list(FAMILIES) if args.families == "all" else [f for f in args.families.split(",") if f]
    )
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"--families: unknown {unknown}; known: {', '.join(FAMILIES)} or 'all'")
    if args.families_only and not families:
        parser.error("--families-only needs --families")
    global DEVICE, DTYPE, SHAPE
    SHAPE = args.shape
    DEVICE = torch.device(args.device)
    DTYPE = getattr(torch, args.dtype)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    tune_allocator()
    torch.set_num_threads(args.threads)
    rows: list[Row] = []
    if SHAPE is not None:
        (large_rows, large_seq, large_prompt), small = SHAPE_BATCHES[SHAPE]
        large_rows = args.rows_per_run or large_rows
        rows += bench_forward_backward(args.repeats, large_rows, large_seq, large_prompt)
        rows += bench_forward_backward(args.repeats, *small)
        where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "CPU"
        print(f"\n{where}, {args.dtype}, torch {torch.__version__}; {SHAPE}, LoRA rank {RANK}\n")
        _print(rows)
        return
    if not args.families_only:
        rows += bench_forward_backward(args.repeats, ROWS_PER_RUN, SEQ, PROMPT)
        rows += bench_forward_backward(args.repeats, 1, 64, 16)
        rows += bench_layer(args.repeats)
        from trainer_processes import bench_trainers

        rows += bench_trainers(args.steps, args.threads, DEVICE, DTYPE)
    rows += bench_families(args.repeats, families)
    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "CPU"
    print(
        f"\n{where}, {args.dtype}, {args.threads} threads, torch {torch.__version__}; model "
        f"hidden {SPEC.hidden_size}, {SPEC.num_hidden_layers} layers, LoRA rank {RANK}\n"
    )
    _print(rows)


def _print(rows: list[Row]) -> None:
    print("| measurement | value | ratio | baseline |")
    print("| --- | --- | --- | --- |")
    for name, shown, ratio, baseline in rows:
        print(f"| {name} | {shown} | {ratio:.2f}x | {baseline} |")
    if DEVICE.type == "cuda":
        print(f"\npeak GPU memory: {torch.cuda.max_memory_allocated(DEVICE) / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
