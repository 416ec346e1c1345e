"""The ``torch`` engine: one base model with a multi-LoRA slot per run, on CPU or GPU.

Requests of every run are batched together. For the model families the paged decoder runs
(services/model/decoder.py: Llama, Mistral, Qwen2, Qwen3) generation is continuous: the first
job waits ``batch_window_ms`` for company, then the worker decodes while jobs join and leave
between decode steps (continuous.py), over a paged KV cache of ``max_batch_tokens`` tokens and
at most ``max_num_seqs`` sequences at once, each decode step a CUDA graph on a GPU. Every
completion of a job comes from one policy version. Other families generate in static batches
(services/model/sampling.py): a batch closes when the oldest job has waited ``batch_window_ms``
or when the next job would push it past ``max_batch_tokens``, and later jobs wait for the next.

All model work runs on one worker thread, so the event loop keeps receiving requests and
weights while a batch generates. New adapters are staged on the loop and written into their
slot by that thread at a generation-step boundary (adapters.py): immediately when idle, or
between two decode steps when no unfinished sequence uses the slot.

Full weights (``WeightsReady.kind == "full"``) go into the base model's own parameters, in place
(no second copy of the model), between two batches: the install takes the lock each batch holds
while it runs, so it waits for the running batch and holds the next one off until the last
byte has landed, and no forward pass ever reads a half-written parameter. From then on the run
generates with no adapter (slot -1), the base model being its policy, and jobs of any other run
are refused. A load that fails after writing part of the parameters leaves the run unserved
(:attr:`TorchEngine.full_weights` with version None) until a good version lands.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from schemas.events import WeightsReady
from services.inference.adapters import AdapterBank, Applied
from services.inference.continuous import (
    ContinuousLoop,
    Waiting,
    bound_version,
    job_result,
    job_specs,
)
from services.inference.jobs import InstalledFullWeights, Job, JobResult, LoadInto, SlotChanged
from services.inference.schedule import WaitingJobs
from services.inference.snapshots import Snapshots
from services.model.paged_generate import PagedGenerator
from services.model.sampling import SequenceSpec, eos_token_ids, generate_batch
from services.weights.errors import WeightsError

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
        target_modules: Sequence[str] | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_window_ms: float = 5.0,
        max_batch_tokens: int = 16384,
        max_num_seqs: int = 256,
        paged: bool = True,
        cuda_graphs: bool = True,
        max_snapshots: int = 0,
        http_share: float = 1.0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.http_share = http_share
        self.max_runs = max_runs
        self.max_snapshots = max_snapshots
        self.snapshots: Snapshots | None = None
        self.max_lora_rank = max_lora_rank
        self.target_modules = None if target_modules is None else tuple(target_modules)
        """the modules given, None for the model family's default; the LoRA layers, once
        loaded, hold the modules they wrap (``lora.target_modules``)"""
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_window = batch_window_ms / 1000.0
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.paged = paged
        self.cuda_graphs = cuda_graphs
        self.generator: PagedGenerator | None = None
        """The continuous-batching generator; None for a family it does not run."""
        self.continuous: ContinuousLoop | None = None
        self._serving = False
        self.applied: deque[Applied] = deque(maxlen=4096)
        """Every adapter written into a slot, newest last (for metrics and benchmarks)."""
        self.num_batches = 0
        self.full_weights: InstalledFullWeights | None = None
        """Whose full weights the base model carries; None while it is the one from disk."""
        self._listener: Callable[[], None] = lambda: None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plexrl-generate")
        self._queue: asyncio.Queue[_Queued] = asyncio.Queue()
        self._batcher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Held by each batch while it generates and by a full-weights install while it writes.
        self._model_lock = asyncio.Lock()
        self.write_guard = threading.Lock()
        """Held by the worker thread while it generates, and by a collective receiver's thread
        while full weights land in the parameters as the broadcast arrives."""
        self._base_params: dict[str, torch.Tensor] = {}
        self.model: Any = None
        self.lora: Any = None
        self.bank: AdapterBank | None = None
        self.vocab_size = 0
        self.max_model_len = 0
        self._eos_ids: list[int] = []
        self.pad_id = 0

    @property
    def eos_ids(self) -> list[int]:
        return self._eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: list[int]) -> None:
        self._eos_ids = list(ids)
        if self.generator is not None:
            self.generator.eos = frozenset(self._eos_ids)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._loop.run_in_executor(self._executor, self._load)
        self._batcher = asyncio.create_task(self._batch_loop(), name="plexrl-batcher")

    def _load(self) -> None:
        from services.model.decoder import unsupported_reason
        from services.model.loader import load_model
        from services.model.lora import MultiLoRA

        model, tokenizer = load_model(self.model_dir, device=self.device, dtype=self.dtype)
        self.model = model
        # Named before the LoRA layers wrap the linears, so the keys are the Hugging Face names a
        # full-weights trainer publishes (tied weights once); the wrapped linears keep these very
        # tensors.
        self._base_params = {name: p.data for name, p in model.named_parameters()}
        slots = self.max_runs + self.max_snapshots
        self.lora = MultiLoRA.attach(model, slots, self.max_lora_rank, self.target_modules)
        self.bank = AdapterBank(self.lora, on_applied=self._on_applied)
        self.snapshots = Snapshots(self.bank, self.max_runs, self.max_snapshots)
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
        self.eos_ids = eos_token_ids(model, tokenizer)
        pad = getattr(config, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (self.eos_ids or [0])[0])
        reason = (
            unsupported_reason(model, min(self.max_model_len, self.max_batch_tokens))
            if self.paged
            else "anything (paged = false)"
        )
        if reason is not None:
            log.info("generating in static batches: the paged decoder does not run %s", reason)
            return
        self.generator = PagedGenerator(
            model,
            self.lora,
            eos_ids=self.eos_ids,
            max_seqs=self.max_num_seqs,
            cache_tokens=self.max_batch_tokens,
            cuda_graphs=self.cuda_graphs and self.device.type == "cuda",
        )
        self.continuous = ContinuousLoop(
            self.generator,
            self.bank,
            lambda: self.full_weights,
            self._resolve_threadsafe,
            http_share=self.http_share,
        )

    async def close(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
            self._batcher = None
        waiting = [item.future for item in _drain_queue(self._queue)]
        if self.continuous is not None:
            waiting += [w.future for w in self.continuous.pending()]
            self.continuous.inbox.clear()
            self.continuous.waiting = WaitingJobs()
        for future in waiting:
            if not future.done():
                future.set_exception(RuntimeError("the inference engine is shutting down"))
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
        if self.snapshots is not None:
            self.snapshots.forget_run(run_id)
        full = self.full_weights
        if full is not None and full.run_id == run_id and full.version is not None:
            # The parameters stay what they are: a run of the same id created again must not be
            # served them as its version 0.
            self.full_weights = InstalledFullWeights(
                run_id,
                None,
                f"{run_id} was removed while this replica's base model carried its full weights "
                f"(policy version {full.version}); it is served again once its full weights load",
            )
        self._listener()

    def available_version(self, slot: int, run_id: str) -> int | None:
        full = self.full_weights
        if full is not None:
            return full.version if full.run_id == run_id else None
        return self._bank().available_version(slot, run_id)

    async def load_adapter(
        self, slot: int, event: WeightsReady, tensors: dict[str, torch.Tensor]
    ) -> bool:
        full = self.full_weights
        if full is not None and full.run_id == event.run_id:
            raise ValueError(
                f"{event.run_id} is served from full model weights on this replica, so its "
                f"adapter of step {event.step} has nothing to apply to (a trainer publishes either "
                "adapters or full weights of a run, never both)"
            )
        bank = self._bank()
        bank.check_adapter(tensors, event.lora.rank)
        prepared = await asyncio.to_thread(bank.prepare, tensors)
        staged = bank.stage_weights(
            slot, event.run_id, event.step, prepared, event.lora.rank, event.lora.alpha
        )
        if staged:
            self._staged()
        return staged

    def snapshot_slot(self, run_id: str, version: int) -> int | None:
        return None if self.snapshots is None else self.snapshots.slot_of(run_id, version)

    async def pin(
        self,
        slot: int,
        run_id: str,
        version: int,
        event: WeightsReady | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
    ) -> int | None:
        snapshots = self.snapshots
        if snapshots is None or self.full_weights is not None:
            return None
        if tensors is None or event is None:
            pinned = await snapshots.pin_copy(slot, run_id, version)
        else:
            pinned = await snapshots.pin_tensors(
                run_id, version, tensors, event.lora.rank, event.lora.alpha
            )
        if pinned is not None:
            self._staged()
        return pinned

    async def install_full(self, event: WeightsReady, load: LoadInto) -> bool:
        # The lock waits for the running batch and keeps the next one from starting; a
        # continuous batch admits nothing more meanwhile, so it ends.
        if self.continuous is not None:
            self.continuous.drain.set()
        try:
            return await self._install_full(event, load)
        finally:
            if self.continuous is not None:
                self.continuous.drain.clear()

    async def _install_full(self, event: WeightsReady, load: LoadInto) -> bool:
        async with self._model_lock:
            held = self.full_weights
            if (
                held is not None
                and held.run_id == event.run_id
                and held.version is not None
                and held.version >= event.step
            ):
                return False
            started = time.monotonic()
            try:
                await load(self._base_params)
            except BaseException as exc:
                # Only a WeightsError says whether nothing was written; anything else may have
                # stopped the load half way.
                if not isinstance(exc, WeightsError) or exc.touched:
                    self.full_weights = InstalledFullWeights(
                        event.run_id,
                        None,
                        f"the full weights of {event.run_id} at step {event.step} failed to "
                        f"load after part of them was written into the base model ({exc}); the "
                        "run is served again once a good version loads",
                    )
                    self._listener()
                raise
            self.full_weights = InstalledFullWeights(event.run_id, event.step)
        log.info(
            "full weights of %s at step %d installed in place in %.3fs",
            event.run_id,
            event.step,
            time.monotonic() - started,
        )
        self._listener()
        return True

    @property
    def base_parameters(self) -> Mapping[str, torch.Tensor]:
        """The base model's parameters under their Hugging Face names (what full weights fill)."""
        return self._base_params

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
        cont = self.continuous
        if self._serving and cont is not None and not cont.drain.is_set():
            cont.inbox.append(Waiting(job, future))  # joins between two decode steps
        else:
            await self._queue.put(_Queued(job, future))
        return await future

    def _resolve_threadsafe(
        self, future: asyncio.Future[JobResult], outcome: JobResult | BaseException
    ) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(_settle, future, outcome)

    async def _serve(self, live: list[_Queued]) -> None:
        """Continuous batching: the worker generates until no job is left (continuous.py)."""
        assert self._loop is not None and self.continuous is not None
        cont = self.continuous
        cont.inbox.extend(Waiting(q.job, q.future) for q in live)
        while cont.inbox or cont.waiting:
            async with self._model_lock:
                self.num_batches += 1
                self._serving = True
                try:
                    await self._loop.run_in_executor(self._executor, self._serve_guarded)
                finally:
                    self._serving = False

    def _serve_guarded(self) -> None:
        assert self.continuous is not None
        with self.write_guard:
            self.continuous.serve()

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
            if self.continuous is not None:
                await self._serve(live)
                continue
            jobs = [q.job for q in live]
            try:
                async with self._model_lock:
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
        with self.write_guard:
            return self._run_guarded(jobs)

    def _run_guarded(self, jobs: list[Job]) -> list[JobResult | Exception]:
        bank = self._bank()
        bank.apply_staged()
        full = self.full_weights
        outcomes: list[JobResult | Exception] = []
        specs: list[SequenceSpec] = []
        versions: list[int] = []
        for job in jobs:
            slot, version = bound_version(job, bank, full)
            if version is None:
                outcomes.append(SlotChanged(f"slot {job.slot} moved on from {job.run_id}"))
                versions.append(-1)
                continue
            outcomes.append(RuntimeError("not generated"))
            versions.append(version)
            specs.extend(job_specs(job, slot))
        self.num_batches += 1
        outputs = generate_batch(
            self.model,
            self.lora,
            specs,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            step_hook=bank.apply_staged,
        )
        start = 0
        for k, job in enumerate(jobs):
            if versions[k] < 0:
                continue
            count = len(job.prompts) * job.n
            outcomes[k] = job_result(job, versions[k], outputs[start : start + count])
            start += count
        return outcomes


def _settle(future: asyncio.Future[JobResult], outcome: JobResult | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _drain_queue(queue: asyncio.Queue[_Queued]) -> list[_Queued]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _log_failure(future: Any) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("applying a staged adapter failed: %s", future.exception())
