"""The ``torch`` engine: one base model with a multi-LoRA slot per run, on CPU or GPU.

Requests of every run are batched together. Jobs queue on the event loop; a batch closes when
the oldest job has waited ``batch_window_ms`` or when the next job would push the batch past
``max_batch_tokens`` (prompt plus completion tokens, the KV cache it will need). A job is never
split across batches, so all its completions come from one policy version. Jobs that arrive
while a batch runs wait for the next one (no continuous batching: a static batch keeps the KV
cache a plain Hugging Face ``DynamicCache``).

All model work runs on one worker thread, so the event loop keeps receiving requests and
weights while a batch generates. New adapters are staged on the loop and written into their
slot by that thread at a generation-step boundary (adapters.py): immediately when idle, or
between two decode steps of a running batch when no unfinished sequence uses the slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from schemas.events import Completion, WeightsReady
from services.inference.adapters import AdapterBank, Applied
from services.inference.generation import (
    SequenceSpec,
    eos_token_ids,
    generate_batch,
)
from services.inference.jobs import Job, JobResult, SlotChanged
from services.inference.sampling import sequence_seed

log = logging.getLogger(__name__)


@dataclass
class _Queued:
    job: Job
    future: asyncio.Future[JobResult]
    queued_at: float = field(default_factory=time.monotonic)


class TorchEngine:
    """Batched multi-run sampling on one ``MultiLoRA`` model (see the module docstring)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        max_runs: int,
        max_lora_rank: int,
        target_modules: Sequence[str],
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_window_ms: float = 5.0,
        max_batch_tokens: int = 16384,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.max_runs = max_runs
        self.max_lora_rank = max_lora_rank
        self.target_modules = tuple(target_modules)
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_window = batch_window_ms / 1000.0
        self.max_batch_tokens = max_batch_tokens
        self.applied: deque[Applied] = deque(maxlen=4096)
        """Every adapter written into a slot, newest last (for metrics and benchmarks)."""
        self.num_batches = 0
        self._listener: Callable[[], None] = lambda: None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plexrl-generate")
        self._queue: asyncio.Queue[_Queued] = asyncio.Queue()
        self._batcher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.model: Any = None
        self.lora: Any = None
        self.bank: AdapterBank | None = None
        self.vocab_size = 0
        self.max_model_len = 0
        self.eos_ids: list[int] = []
        self.pad_id = 0

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._loop.run_in_executor(self._executor, self._load)
        self._batcher = asyncio.create_task(self._batch_loop(), name="plexrl-batcher")

    def _load(self) -> None:
        from services.model.loader import load_model
        from services.model.lora import MultiLoRA

        model, tokenizer = load_model(self.model_dir, device=self.device, dtype=self.dtype)
        self.model = model
        self.lora = MultiLoRA.attach(model, self.max_runs, self.max_lora_rank, self.target_modules)
        self.bank = AdapterBank(self.lora, on_applied=self._on_applied)
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
        self.eos_ids = eos_token_ids(model, tokenizer)
        pad = getattr(config, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (self.eos_ids or [0])[0])

    async def close(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
            self._batcher = None
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if not item.future.done():
                item.future.set_exception(RuntimeError("the inference engine is shutting down"))
        await asyncio.to_thread(self._executor.shutdown, wait=True)

    def set_listener(self, listener: Callable[[], None]) -> None:
        self._listener = listener

    # --- adapters ----------------------------------------------------------------------------

    def _bank(self) -> AdapterBank:
        if self.bank is None:
            raise RuntimeError("the torch engine is not started")
        return self.bank

    def add_run(self, slot: int, run_id: str, rank: int, alpha: float) -> None:
        self._bank().stage_reset(slot, run_id, rank, alpha)
        self._staged()

    def remove_run(self, slot: int, run_id: str) -> None:
        # Deletion hooks run before creation hooks, so whatever the slot holds is this run's.
        self._bank().forget(slot)
        self._listener()

    def available_version(self, slot: int, run_id: str) -> int | None:
        return self._bank().available_version(slot, run_id)

    async def load_adapter(
        self, slot: int, event: WeightsReady, tensors: dict[str, torch.Tensor]
    ) -> bool:
        bank = self._bank()
        bank.check_adapter(tensors, event.lora.rank)
        prepared = await asyncio.to_thread(bank.prepare, tensors)
        staged = bank.stage_weights(
            slot, event.run_id, event.step, prepared, event.lora.rank, event.lora.alpha
        )
        if staged:
            self._staged()
        return staged

    def _staged(self) -> None:
        """Wake waiters, and have the worker apply the target now if it is idle."""
        self._listener()
        assert self._loop is not None
        future = self._loop.run_in_executor(self._executor, self._bank().apply_staged)
        future.add_done_callback(_log_failure)

    def _on_applied(self, done: list[Applied]) -> None:
        # Called on the worker thread.
        self.applied.extend(done)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._listener)

    # --- generation --------------------------------------------------------------------------

    async def generate(self, job: Job) -> JobResult:
        future: asyncio.Future[JobResult] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Queued(job, future))
        return await future

    async def _batch_loop(self) -> None:
        assert self._loop is not None
        carry: _Queued | None = None
        while True:
            first = carry if carry is not None else await self._queue.get()
            carry = None
            batch, tokens = [first], first.job.token_budget
            deadline = first.queued_at + self.batch_window
            while tokens < self.max_batch_tokens:
                try:
                    if self._queue.empty():
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        item = await asyncio.wait_for(self._queue.get(), remaining)
                    else:
                        item = self._queue.get_nowait()
                except TimeoutError:
                    break
                if tokens + item.job.token_budget > self.max_batch_tokens:
                    carry = item
                    break
                batch.append(item)
                tokens += item.job.token_budget
            live = [q for q in batch if not q.future.done()]
            if not live:
                continue
            jobs = [q.job for q in live]
            try:
                outcomes = await self._loop.run_in_executor(self._executor, self._run, jobs)
            except Exception as exc:
                log.exception("generation of a batch of %d jobs failed", len(jobs))
                outcomes = [exc] * len(jobs)
            for queued, outcome in zip(live, outcomes, strict=True):
                if queued.future.done():
                    continue
                if isinstance(outcome, BaseException):
                    queued.future.set_exception(outcome)
                else:
                    queued.future.set_result(outcome)

    def _run(self, jobs: list[Job]) -> list[JobResult | Exception]:
        """Worker thread: apply staged adapters, then generate every job that still fits."""
        bank = self._bank()
        bank.apply_staged()
        outcomes: list[JobResult | Exception] = []
        specs: list[SequenceSpec] = []
        versions: list[int] = []
        for job in jobs:
            state = bank.loaded(job.slot)
            if state is None or state.run_id != job.run_id or state.version < job.min_version:
                outcomes.append(SlotChanged(f"slot {job.slot} moved on from {job.run_id}"))
                versions.append(-1)
                continue
            outcomes.append(RuntimeError("not generated"))
            versions.append(state.version)
            for i, prompt in enumerate(job.prompts):
                for j in range(job.n):
                    specs.append(
                        SequenceSpec(
                            prompt_ids=prompt,
                            slot=job.slot,
                            max_tokens=job.max_tokens,
                            temperature=job.temperature,
                            top_p=job.top_p,
                            seed=sequence_seed(job.seed, i, j),
                        )
                    )
        self.num_batches += 1
        outputs = iter(
            generate_batch(
                self.model,
                self.lora,
                specs,
                eos_ids=self.eos_ids,
                pad_id=self.pad_id,
                step_hook=bank.apply_staged,
            )
        )
        for k, job in enumerate(jobs):
            if versions[k] < 0:
                continue
            completions = []
            for _ in job.prompts:
                group = []
                for _ in range(job.n):
                    out = next(outputs)
                    group.append(
                        Completion(
                            token_ids=out.token_ids,
                            logprobs=out.logprobs,
                            finish_reason=out.finish_reason,
                        )
                    )
                completions.append(group)
            outcomes[k] = JobResult(policy_version=versions[k], completions=completions)
        return outcomes


def _log_failure(future: Any) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("applying a staged adapter failed: %s", future.exception())
