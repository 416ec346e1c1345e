"""Warm start: pre-train the tiny model on demonstrations of the built-in tasks, most of them
showing a plausible mistake.

RL improves a policy that is already partly right; from random weights GRPO on the toy tasks
sees rewards near zero and flat groups, so it learns nothing. ``pretrain`` gives the tiny model
a base that knows each task's format and its right answer, but whose *most likely* answer is
wrong on a real share of prompts: the headroom a run's LoRA adapter then climbs, and one that
turning the base's temperature down does not reach.

Method. Next-token prediction (cross-entropy, mean over tokens) on ``<bos> + demonstration +
<eos>``, the demonstrations drawn round-robin from the environments (``Environment.prompt``,
split into prompt text and target so that only the answer is changed), all weights, AdamW,
linear warm-up and cosine decay. With probability ``slip_rate`` (0.65) a demonstration's
answer is the task's slip (:meth:`Environment.slip`) instead of the target: ``reverse``,
``copy`` and ``rotate`` stop one letter early, ``upper`` leaves the last letter lowercase,
``add`` forgets the carry. The model learns both answers and prefers the slip: greedy decoding
gives it on nearly every prompt of the string tasks, or every prompt with a carry (``add``),
while sampling at temperature 1 finds the right answer about a third of the time. Lowering the
temperature makes the base worse, so the best the base does on held-out prompts is its sampled
reward, and a run that learns to finish the word (or its last letter) beats it by a wide
margin (docs/getting-started.md). ``add`` is the exception: the tiny model memorises its
training sums rather than learning to add, so RL has no rule to sharpen there (the same page
says so).

Optionally (``noise`` > 0, off by default) the last ``noisy_fraction`` of the steps train only
the read-out (the last block's MLP and the final norm) on answers whose characters are replaced
with probability ``noise`` by a random character of the task's answer alphabet (and with
probability ``noise / 3`` lose their last character or gain a random one). That flattens the
output distribution without rewriting the circuits that solve the tasks: the warm start of
earlier plexrl builds, whose base was mostly right greedily, so that RL only sharpened it.
Measured alternatives to the slips:

- slips from a clean start (exact answers first, slips only in the last 30% of the steps): on
  all weights the answers become a blend of the two (``reverse``: 2.5% slips, 19% exact
  greedily); on the read-out alone the slip is not learned at all (1.5%);
- a slip that changes the first letter (``reverse`` answered by copying): the tiny model does
  not commit to one answer after its first letter and mixes the two (60% slips, 1.5% exact);
- two-digit plus two-digit sums (thousands of prompts): not learned in this budget (6% exact
  greedily); two-digit plus one-digit sums are (every sum without a carry exact).

The run is deterministic: data come from string-seeded ``random.Random`` streams, torch runs
with deterministic algorithms and a fixed thread count, so the same seed gives bit-identical
weights (on the same torch build and CPU). The caller's RNG, thread count and determinism
setting are restored afterwards. One thread is the default: for a model this small a second
one gains little, and when another process keeps one of two cores busy, two OpenMP threads
wait on each other and a step takes 3-8 times longer (measured: 36-52 ms against 127-291 ms).

Prompts, completions and scores follow the convention of :mod:`services.envs.prompts`, the one
the orchestrator uses; evaluation samples with :mod:`services.model.sampling`, the inference
engine's sampler.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.envs import (
    Environment,
    encode_text,
    load_environment,
    prompt_token_ids,
    score_completion,
)
from services.model.loader import check_model_dir, load_model, quiet_progress_bars
from services.model.routing import NO_ADAPTER
from services.model.sampling import SequenceSpec, generate_batch, sequence_seed

DEFAULT_ENVS = ("reverse", "copy", "upper", "rotate", "add")
DEFAULT_STEPS = 2500
DEFAULT_SLIP_RATE = 0.65
DEFAULT_NOISE = 0.0
DEFAULT_BATCH_SIZE = 48
DEFAULT_LR = 3e-3
DEFAULT_NOISY_FRACTION = 0.0
DEFAULT_NUM_THREADS = 1
DEFAULT_MAX_TOKENS = 12

PRETRAIN_FILE = "pretrain.json"
"""Written into the model directory with the weights; its presence marks a pre-trained model."""

PRETRAIN_ENV_SEED = 1_000_003
"""Offset of the environments' seed during pre-training, so the demonstrations are not the
prompts that RL runs (environment seed 0, 1, ...) and the evaluation later see."""

_WARMUP_FRACTION = 0.05
_EVAL_PROMPTS = 128


@dataclass(frozen=True, kw_only=True)
class PretrainReport:
    """What a pre-training run did; ``pretrain.json`` holds the same but for the per-step losses
    and the time taken, so that the same seed writes the same directory, byte for byte."""

    path: Path
    steps: int
    seed: int
    noise: float
    losses: tuple[float, ...]
    """Training loss of every step, in order."""
    final_loss: float
    """Mean loss over the last tenth of the steps (the noisy phase, so it stays well above 0)."""
    rewards: dict[str, float]
    """Mean reward per environment of completions sampled at temperature 1 after training."""
    seconds: float


def corrupt_answer(answer: str, alphabet: str, noise: float, rng: random.Random) -> str:
    """``answer`` with characters replaced (probability ``noise`` each) and its length jittered.

    With probability ``noise / 3`` the last character is dropped (if one would remain) or a
    random one appended, half and half; new characters come from ``alphabet``.
    """
    chars = [rng.choice(alphabet) if rng.random() < noise else c for c in answer]
    jitter = rng.random()
    if jitter < noise / 6 and len(chars) > 1:
        chars.pop()
    elif noise / 6 <= jitter < noise / 3:
        chars.append(rng.choice(alphabet))
    return "".join(chars)


def answer_alphabet(env: Environment, num_prompts: int = 256) -> str:
    """The characters the targets of ``env``'s first prompts use, sorted."""
    return "".join(sorted({c for i in range(num_prompts) for c in env.prompt(i).target}))


class DemonstrationStream:
    """Batches of demonstrations (slipped or corrupted as asked), the environments in turn.

    Batch ``step`` is a pure function of the seed, the environments and ``step``: rows come from
    training prompts ``step * rows_per_env + k`` (``Environment.train_prompt``: the held-out
    split is never demonstrated, so held-out evaluation stays held out for the base too) and the
    slips and corruption from a generator seeded with the step, so a run restarted at any step
    sees the same data. A row shows the task's slip instead of its target with probability
    ``slip_rate`` (when the task has a slip for that prompt).
    """

    def __init__(
        self,
        tokenizer: Any,
        envs: Sequence[Environment],
        batch_size: int,
        seed: int,
        slip_rate: float = 0.0,
    ) -> None:
        if batch_size < len(envs):
            raise ValueError(f"batch_size {batch_size} is smaller than the {len(envs)} envs")
        if not 0.0 <= slip_rate <= 1.0:
            raise ValueError(f"slip_rate must be in [0, 1], got {slip_rate}")
        self.tokenizer = tokenizer
        self.envs = list(envs)
        self.alphabets = [answer_alphabet(env) for env in self.envs]
        self.batch_size = batch_size
        self.seed = seed
        self.slip_rate = slip_rate

    def batch(self, step: int, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids_BT, answer_BT)``: right-padded token ids and a mask of answer + ``<eos>``."""
        rng = random.Random(f"pretrain-noise:{self.seed}:{step}")
        rows_per_env = math.ceil(self.batch_size / len(self.envs))
        eos = int(self.tokenizer.eos_token_id)
        rows: list[tuple[list[int], list[int]]] = []
        for row in range(self.batch_size):
            which = row % len(self.envs)
            env = self.envs[which]
            prompt = env.train_prompt(step * rows_per_env + row // len(self.envs))
            answer = prompt.target
            if self.slip_rate and rng.random() < self.slip_rate:
                answer = env.slip(prompt) or answer
            answer = corrupt_answer(answer, self.alphabets[which], noise, rng)
            rows.append(
                (
                    prompt_token_ids(self.tokenizer, prompt.text),
                    [*encode_text(self.tokenizer, answer), eos],
                )
            )
        width = max(len(p) + len(a) for p, a in rows)
        ids_BT = torch.full((len(rows), width), int(self.tokenizer.pad_token_id))
        answer_BT = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, (p, a) in enumerate(rows):
            ids_BT[i, : len(p) + len(a)] = torch.tensor(p + a)
            answer_BT[i, len(p) : len(p) + len(a)] = True
        return ids_BT, answer_BT


def lm_loss(model: Any, ids_BT: torch.Tensor, loss_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions ``loss_BT`` marks (as targets)."""
    logits_BTV = model(input_ids=ids_BT).logits[:, :-1]
    targets_BT, mask_BT = ids_BT[:, 1:], loss_BT[:, 1:]
    return torch.nn.functional.cross_entropy(logits_BTV[mask_BT], targets_BT[mask_BT])


def evaluate(
    model: Path | str | tuple[Any, Any],
    env_names: Sequence[str] = DEFAULT_ENVS,
    n_prompts: int = _EVAL_PROMPTS,
    temperature: float = 1.0,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    seed: int = 0,
    env_seed: int = 0,
) -> dict[str, float]:
    """Mean reward per environment of one completion sampled for each of ``n_prompts`` prompts.

    ``model`` is a model directory or a loaded ``(model, tokenizer)``. Prompts are indices
    ``0..n_prompts-1`` of each environment built with ``env_seed``; completion ``i`` of the
    ``k``-th environment draws from its own generator seeded with ``sequence_seed(seed, k, i)``,
    so the result is reproducible. Temperature 0 samples greedily.
    """
    if isinstance(model, tuple):
        lm, tokenizer = model
    else:
        lm, tokenizer = load_model(model)
    eos = int(tokenizer.eos_token_id)
    rewards: dict[str, float] = {}
    for k, name in enumerate(env_names):
        env = load_environment(name, seed=env_seed)
        prompts = [env.prompt(i) for i in range(n_prompts)]
        specs = [
            SequenceSpec(
                prompt_ids=prompt_token_ids(tokenizer, p.text),
                slot=NO_ADAPTER,
                max_tokens=max_tokens,
                temperature=temperature,
                seed=sequence_seed(seed, k, i),
            )
            for i, p in enumerate(prompts)
        ]
        outputs = generate_batch(lm, None, specs, eos_ids=[eos], pad_id=int(tokenizer.pad_token_id))
        scores = [
            score_completion(env, tokenizer, p, out.token_ids)
            for p, out in zip(prompts, outputs, strict=True)
        ]
        rewards[name] = sum(scores) / len(scores)
    return rewards


def pretrain(
    model_dir: Path,
    *,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    envs: Sequence[str] = DEFAULT_ENVS,
    slip_rate: float = DEFAULT_SLIP_RATE,
    noise: float = DEFAULT_NOISE,
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float = DEFAULT_LR,
    noisy_fraction: float = DEFAULT_NOISY_FRACTION,
    prompt_loss: bool = True,
    num_threads: int = DEFAULT_NUM_THREADS,
    eval_prompts: int = _EVAL_PROMPTS,
    log: Callable[[str], None] | None = None,
) -> PretrainReport:
    """Pre-train the model in ``model_dir`` in place and write ``pretrain.json`` beside it.

    See the module docstring for the method. The defaults took 68 s on two CPU cores (2,500
    steps, one thread). ``log`` receives a progress line (mean loss of the
    last steps) ten times per run. The directory is swapped whole at the end, so a reader sees
    either the old model or the pre-trained one with its ``pretrain.json``, never a mix.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 0.0 <= noise <= 1.0 or not 0.0 <= noisy_fraction <= 1.0:
        raise ValueError(f"noise ({noise}) and noisy_fraction ({noisy_fraction}) must be in [0, 1]")
    if not envs:
        raise ValueError("pretrain needs at least one environment")
    model_dir = check_model_dir(model_dir)
    started = time.perf_counter()
    with _reproducible(seed, num_threads):
        model, tokenizer = load_model(model_dir)
        stream = DemonstrationStream(
            tokenizer,
            [load_environment(name, seed=PRETRAIN_ENV_SEED + seed) for name in envs],
            batch_size,
            seed,
            slip_rate,
        )
        losses = _train(model, stream, steps, lr, noise, noisy_fraction, prompt_loss, log)
        model.eval()
        rewards = evaluate((model, tokenizer), envs, n_prompts=eval_prompts, seed=seed)
    tail = losses[-max(1, steps // 10) :]
    final_loss = sum(tail) / len(tail)
    record = {
        "steps": steps,
        "seed": seed,
        "envs": list(envs),
        "slip_rate": slip_rate,
        "noise": noise,
        "noisy_fraction": noisy_fraction,
        "batch_size": batch_size,
        "lr": lr,
        "prompt_loss": prompt_loss,
        "num_threads": num_threads,
        "final_loss": final_loss,
        "rewards": rewards,
        "eval": {
            "n_prompts": eval_prompts,
            "temperature": 1.0,
            "max_tokens": DEFAULT_MAX_TOKENS,
            "env_seed": 0,
            "sampling_seed": seed,
        },
        "prompt_format": "<bos> + prompt text; completion = answer + <eos>",
    }
    _swap_in(model, model_dir, record)
    return PretrainReport(
        path=model_dir,
        steps=steps,
        seed=seed,
        noise=noise,
        losses=tuple(losses),
        final_loss=final_loss,
        rewards=rewards,
        seconds=time.perf_counter() - started,
    )


def readout_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The parameters the noisy phase trains: the last decoder block's MLP and the final norm.

    Named for the Llama layout (``model.model.layers``, ``model.model.norm``) the tiny model
    uses; the embeddings are tied to the output head, so they stay frozen with the rest.
    """
    modules = (model.model.layers[-1].mlp, model.model.norm)
    return [param for module in modules for param in module.parameters()]


def _train(
    model: Any,
    stream: DemonstrationStream,
    steps: int,
    lr: float,
    noise: float,
    noisy_fraction: float,
    prompt_loss: bool,
    log: Callable[[str], None] | None,
) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    warmup = max(1, round(_WARMUP_FRACTION * steps))
    first_noisy = steps - round(noisy_fraction * steps)
    log_every = max(1, steps // 10)
    losses: list[float] = []
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = (
                lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
            )
        if step == first_noisy:
            # Frozen parameters keep a None gradient, which AdamW and clipping skip.
            model.requires_grad_(False)
            for param in readout_parameters(model):
                param.requires_grad_(True)
        ids_BT, answer_BT = stream.batch(step, noise if step >= first_noisy else 0.0)
        loss_BT = ids_BT != stream.tokenizer.pad_token_id if prompt_loss else answer_BT
        loss = lm_loss(model, ids_BT, loss_BT)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if log is not None and ((step + 1) % log_every == 0 or step + 1 == steps):
            recent = losses[-log_every:]
            phase = "read-out, noisy" if step >= first_noisy else "all weights"
            log(f"pretrain step {step + 1}/{steps} ({phase}) loss {sum(recent) / len(recent):.3f}")
    return losses


@contextmanager
def _reproducible(seed: int, num_threads: int) -> Iterator[None]:
    """Fixed seed, thread count and deterministic kernels inside; the caller's afterwards."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(num_threads)
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(deterministic)
            torch.set_num_threads(threads)


def _swap_in(model: Any, model_dir: Path, record: dict[str, Any]) -> None:
    """Replace ``model_dir`` by a copy holding the new weights and ``record`` as pretrain.json.

    The copy is built in a staging directory next to ``model_dir`` (same filesystem, so the
    renames are atomic) and renamed into place; the old directory moves into the staging area
    and is deleted only once the new one is in.
    """
    model_dir = model_dir.resolve()
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.pretrain-", dir=model_dir.parent))
    new_dir, backup = staging / "new", staging / "old"
    try:
        shutil.copytree(model_dir, new_dir)
        with quiet_progress_bars():
            model.save_pretrained(str(new_dir), safe_serialization=True)
        (new_dir / PRETRAIN_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        model_dir.rename(backup)
        try:
            new_dir.rename(model_dir)
        except BaseException:
            backup.rename(model_dir)
            raise
    finally:
        # Never delete the staging area while it holds the only copy of the model.
        if model_dir.is_dir():
            shutil.rmtree(staging, ignore_errors=True)
