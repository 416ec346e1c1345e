"""Every model family trains through the real services, and the replica serves what it trained.

For each family of ``services.model.families`` a tiny random model is written to a directory
with the character tokenizer, and the registry, one trainer, one inference replica (torch
engine) and one orchestrator run in this process, each on its own connection to a nats-server
of the test's own. One run trains two steps synchronously (``max_async_level = 0``), so:

- the batch of step 1 was sampled under policy version 1, the adapter the trainer published
  after step 0: the replica installed it and served it to the orchestrator;
- asked afterwards for version 2, the replica answers with version 2, and its log-probabilities
  are the trainer's forward under the run's slot (to 1e-4), not the base model's.

The services share this process (as in tests/trainer and tests/inference) rather than running
as ``plexrl up``'s child processes: a process start costs seconds of imports on CI's two cores,
and the code under test (model loading, LoRA attach, weight publishing and install, sampling,
training) is the same.
"""

from __future__ import annotations

import asyncio
import json
import string
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from schemas.config import OrchConfig
from schemas.events import GenerateRequest, GenerateResponse
from schemas.subjects import GENERATE
from services.bus import Bus, EmbeddedNats
from services.envs import Environment, Prompt
from services.inference.service import InferenceService
from services.inference.torch_engine import TorchEngine
from services.model.families import FAMILIES, tiny_family_model
from services.model.tokenizer import build_char_tokenizer, save_char_tokenizer
from services.orchestrator.metrics import metrics_path
from services.orchestrator.run_loop import RunOrchestrator
from services.registry.service import Registry
from services.registry.settings import RegistrySettings
from services.trainer.checkpoint import read_step_log
from services.trainer.loss import selected_logprobs
from services.trainer.service import Trainer, build_model
from services.trainer.settings import TrainerSettings

T = TypeVar("T")

pytestmark = pytest.mark.slow

RUN = "run_family"
STEPS = 2
RANK, ALPHA = 4, 8.0
MAX_TOKENS = 6


class LowercaseEnv(Environment):
    """Reward: the share of lowercase letters in the completion.

    26 of the character tokenizer's 90 tokens are lowercase letters, so a random model's
    completions score between 0 and 1, the rewards within a group spread, and a step has
    non-zero advantages, hence a gradient (``reverse`` scores a random model 0 almost
    everywhere, which would leave the adapter as it was).
    """

    name = "lowercase"
    heldout_fraction = 0.0

    def prompt(self, index: int) -> Prompt:
        rng = self.rng(index)
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
        return Prompt(text=f"copy: {word}=", target=word)

    def score(self, prompt: Prompt, completion_text: str) -> float:
        if not completion_text:
            return 0.0
        return sum(c in string.ascii_lowercase for c in completion_text) / len(completion_text)


def write_family_model(family: str, out_dir: Path) -> Path:
    """``family``'s tiny random model and the character tokenizer, as a model directory.

    The families' token ids (pad 0, bos 1, eos 2) are the character tokenizer's, and their
    vocabulary (96) covers its 90 tokens.
    """
    model = tiny_family_model(family, seed=0)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    save_char_tokenizer(out_dir)
    return out_dir


async def eventually(check: Callable[[], Awaitable[T]], timeout: float) -> T:
    deadline = time.monotonic() + timeout
    while not (value := await check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value {value!r})")
        await asyncio.sleep(0.05)
    return value


class Deployment:
    """Registry, trainer and one inference replica on one model, in this process."""

    def __init__(self, url: str, model_dir: Path, out: Path) -> None:
        self.url, self.model_dir, self.out = url, model_dir, out
        self.settings = TrainerSettings(
            model=model_dir,
            output_dir=out,
            max_runs=1,
            max_lora_rank=RANK,
            micro_batch_tokens=512,
            ack_wait=30.0,
            unknown_run_hold=0.5,
        )
        self.buses: list[Bus] = []
        self.registry: Registry | None = None
        self.inference: InferenceService | None = None
        self.stop_trainer = asyncio.Event()
        self.trainer_task: asyncio.Task[None] | None = None

    async def connect(self, service: str) -> Bus:
        bus = await Bus.connect(self.url, service)
        self.buses.append(bus)
        return bus

    async def start(self) -> None:
        registry = Registry(
            await self.connect("registry"),
            RegistrySettings(output_dir=self.out, max_runs=1, scan_interval=3600.0),
        )
        await registry.start()
        self.registry = registry
        self.model, self.lora, pad_id, vocab_size = build_model(self.settings, torch.device("cpu"))
        self.trainer = Trainer(
            self.settings,
            await self.connect("trainer"),
            self.model,
            self.lora,
            pad_id=pad_id,
            vocab_size=vocab_size,
        )
        self.trainer_task = asyncio.create_task(self.trainer.run(self.stop_trainer))
        engine = TorchEngine(self.model_dir, max_runs=1, max_lora_rank=RANK, batch_window_ms=1.0)
        inference = InferenceService(
            await self.connect("inference"),
            engine,
            max_runs=1,
            replica_name="families",
            output_dir=self.out,
        )
        await inference.start()
        self.inference = inference

    async def close(self) -> None:
        """Stop every service (once, however often called)."""
        self.stop_trainer.set()
        if self.trainer_task is not None:
            await asyncio.wait_for(self.trainer_task, 30.0)
        if self.inference is not None:
            await self.inference.stop()
            self.inference = None
        if self.registry is not None:
            await self.registry.stop()
            self.registry = None
        buses, self.buses = self.buses, []
        for bus in buses:
            await bus.close()


@pytest.fixture
async def deploy(server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    started: list[Deployment] = []

    async def start(model_dir: Path) -> Deployment:
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        deployment = Deployment(server.url, model_dir, out)
        started.append(deployment)
        await deployment.start()
        return deployment

    yield start
    for deployment in started:
        await deployment.close()


def metrics_lines(out: Path) -> list[dict[str, Any]]:
    """The orchestrator's ``metrics.jsonl``: one object per published step."""
    return [json.loads(line) for line in metrics_path(out, RUN).read_text().splitlines()]


def forward_logprobs(
    stack: Deployment, prompt: list[int], completion: list[int], slot: int
) -> list[float]:
    """Log-probabilities of ``completion`` after ``prompt`` under the trainer's ``slot`` (-1:
    the base model), at temperature 1, as the trainer scores a sample."""
    model, lora = stack.model, stack.lora
    ids = [*prompt, *completion]
    with torch.no_grad(), lora.use(torch.tensor([slot])):
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits
    lp = selected_logprobs(logits, torch.tensor([ids[1:]]))
    return [float(x) for x in lp[0, len(prompt) - 1 :]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", list(FAMILIES))
async def test_a_short_run_changes_the_served_version(
    family: str, tmp_path: Path, deploy: Callable[..., Awaitable[Deployment]]
) -> None:
    model_dir = write_family_model(family, tmp_path / "model")
    stack = await deploy(model_dir)
    bus = await stack.connect("test")
    tokenizer = build_char_tokenizer()
    config = OrchConfig.model_validate(
        {
            "env": "copy",  # the name the registry checks; the environment is LowercaseEnv
            "seed": 3,
            "max_steps": STEPS,
            "batch_size": 2,
            "group_size": 4,
            "max_async_level": 0,
            "sampling": {"temperature": 1.0, "max_tokens": MAX_TOKENS},
            "optim": {"lr": 0.02},
            "model": {"lora": {"rank": RANK, "alpha": ALPHA}},
            "eval": {"interval": 0},
        }
    )
    orchestrator = RunOrchestrator(
        bus,
        RUN,
        config,
        output_dir=stack.out,
        tokenizer=tokenizer,
        env=LowercaseEnv(seed=3),
        request_timeout=30.0,
    )
    result = await asyncio.wait_for(orchestrator.run(asyncio.Event()), 90)
    assert (result.status, result.policy_version) == ("done", STEPS), result

    # Step 1 was sampled under the adapter trained on step 0: the replica installed version 1.
    steps = metrics_lines(stack.out)
    assert [(m["step"], m["policy_version"]) for m in steps] == [(0, 0), (1, 1)]
    assert steps[0]["zero_spread_frac"] < 1.0  # a group's rewards spread: step 0 had a gradient

    # Asked for the final version, the replica serves it.
    registry, replica = stack.registry, stack.inference
    assert registry is not None and replica is not None
    idx = registry.idx_of(RUN)
    assert idx is not None

    async def installed() -> bool:
        return (RUN, STEPS) in replica.installed_at

    await eventually(installed, timeout=10)
    prompt = tokenizer("copy: abc=")["input_ids"]
    request = GenerateRequest(
        request_id=f"{family}-final",
        run_id=RUN,
        prompts=[prompt],
        n=4,
        max_tokens=MAX_TOKENS,
        min_policy_version=STEPS,
        seed=11,
    )
    reply = await bus.request(GENERATE, request, GenerateResponse, timeout=30.0)
    assert reply.error is None, reply.error
    assert reply.policy_version == STEPS
    await stack.close()  # the trainer's model and slots hold version STEPS and stay still now
    trained = read_step_log(stack.out, RUN)
    assert [(t["step"], t["batch_policy_version"]) for t in trained] == [(0, 0), (1, 1)]

    # The served log-probabilities are the trained adapter's, and not the base model's.
    moved = 0.0
    for completion in reply.completions[0]:
        served = completion.logprobs
        policy = forward_logprobs(stack, prompt, completion.token_ids, slot=idx)
        base = forward_logprobs(stack, prompt, completion.token_ids, slot=-1)
        assert served == pytest.approx(policy, abs=1e-4)
        moved = max(moved, *(abs(s - b) for s, b in zip(served, base, strict=True)))
    assert moved > 1e-2, f"{family}: the served policy is the base model's"
