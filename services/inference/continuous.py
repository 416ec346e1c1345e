"""The torch engine's generation loop: jobs join and leave between decode steps.

The worker thread runs :meth:`ContinuousLoop.serve` while there is work. Each turn it

1. applies staged adapters to every slot no unfinished sequence (and no half-admitted job)
   uses, so a swap never lands inside a job;
2. admits waiting jobs in arrival order: a job's slot must still hold its run at a version the
   job accepts (else :class:`SlotChanged`), and its sequences join the decode batch as rows and
   KV blocks allow; a job bigger than what is free joins part by part, its slot counting as
   busy until the last part is in, so every completion of a job comes from one policy version;
3. decodes one token for every row, and completes each job whose last sequence finished.

It returns when nothing is left, or when a full-weights install asks it to drain (starts no
new job, finishes what runs, and leaves the waiting jobs for the next turn).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schemas.events import Completion, PromptLogprobs, TopLogprobs
from services.inference.adapters import AdapterBank
from services.inference.jobs import InstalledFullWeights, Job, JobResult, SlotChanged
from services.model.paged_generate import PagedGenerator
from services.model.routing import NO_ADAPTER
from services.model.sampling import SequenceOutput, SequenceSpec, sequence_seed

log = logging.getLogger(__name__)

Resolve = Callable[[asyncio.Future[JobResult], JobResult | BaseException], None]


def job_specs(job: Job, slot: int) -> list[SequenceSpec]:
    """The job's sequences, prompt-major (completion j of prompt i at ``i * n + j``); the first
    completion of each prompt scores the prompt when the job asks for it."""
    return [
        SequenceSpec(
            prompt_ids=prompt,
            slot=slot,
            max_tokens=job.max_tokens,
            temperature=job.temperature,
            top_p=job.top_p,
            seed=sequence_seed(job.seed, i, j),
            top_k=job.top_k,
            ignore_eos=job.ignore_eos,
            top_logprobs=job.top_logprobs,
            score_prompt=job.prompt_logprobs and j == 0,
        )
        for i, prompt in enumerate(job.prompts)
        for j in range(job.n)
    ]


def _top(entries: list[list[tuple[int, float]]]) -> list[TopLogprobs]:
    return [
        TopLogprobs(token_ids=[i for i, _ in row], logprobs=[v for _, v in row]) for row in entries
    ]


def job_result(job: Job, version: int, outputs: list[SequenceOutput]) -> JobResult:
    groups = [outputs[i * job.n : (i + 1) * job.n] for i in range(len(job.prompts))]
    completions = [
        [
            Completion(
                token_ids=o.token_ids,
                logprobs=o.logprobs,
                finish_reason=o.finish_reason,
                top_logprobs=_top(o.top_logprobs),
            )
            for o in group
        ]
        for group in groups
    ]
    scores = []
    if job.prompt_logprobs:
        scores = [
            PromptLogprobs(
                logprobs=list(group[0].prompt_logprobs or []),
                top_logprobs=_top(group[0].prompt_top_logprobs or []),
            )
            for group in groups
        ]
    return JobResult(policy_version=version, completions=completions, prompt_logprobs=scores)


def bound_version(
    job: Job, bank: AdapterBank, full: InstalledFullWeights | None
) -> tuple[int, int | None]:
    """``(slot, version)`` a job would generate with now: its slot (no adapter for the base
    model or a full-weights run), and the version that serves it, or None when it cannot be
    served (its slot moved on, or is not at the exact version it asks for)."""
    if full is not None:  # the base model is the full-weights run's policy, and no other run's
        version = full.version if full.run_id == job.run_id and job.slot != NO_ADAPTER else None
        return NO_ADAPTER, version
    if job.slot == NO_ADAPTER:
        return NO_ADAPTER, 0
    state = bank.loaded(job.slot)
    version = state.version if state is not None and state.run_id == job.run_id else None
    if version is not None and (
        version < job.min_version or (job.exact and version != job.min_version)
    ):
        version = None
    return job.slot, version


@dataclass(eq=False)
class Waiting:
    """A job handed to the loop, and its future (resolved on the event loop)."""

    job: Job
    future: asyncio.Future[JobResult]


@dataclass(eq=False)
class _Admitted:
    waiting: Waiting
    version: int
    specs: list[SequenceSpec]
    outputs: list[SequenceOutput | None]
    next_spec: int = 0
    remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self.remaining = len(self.specs)


class ContinuousLoop:
    """Serves jobs on one PagedGenerator (see the module docstring); worker thread only."""

    def __init__(
        self,
        generator: PagedGenerator,
        bank: AdapterBank,
        full_weights: Callable[[], InstalledFullWeights | None],
        resolve: Resolve,
    ) -> None:
        self.generator = generator
        self.bank = bank
        self.full_weights = full_weights
        self.resolve = resolve
        self.inbox: deque[Waiting] = deque()
        """Jobs handed over by the event loop (appends there, pops here)."""
        self.drain = threading.Event()
        """Set by a full-weights install: admit nothing more until it is cleared."""
        self._partial: _Admitted | None = None

    def _busy(self) -> set[int]:
        busy = self.generator.busy_slots
        if self._partial is not None:
            busy.add(self._partial.specs[0].slot)
        return busy

    def serve(self) -> None:
        """Generate until no job is left (or a drain is asked for and what runs has finished)."""
        gen = self.generator
        try:
            while True:
                self.bank.apply_staged(self._busy())
                # Draining, a half-admitted job still gets the rest of its sequences in.
                self._admit(start_new=not self.drain.is_set())
                if not gen.active:
                    if self._partial is None and (self.drain.is_set() or not self.inbox):
                        return
                    continue
                for seq in gen.step():
                    self._finished(seq.tag, seq.output)
        except Exception as exc:
            log.exception("generation failed; failing every job the engine held")
            failed = {id(s.tag[0]): s.tag[0] for s in gen.active}
            gen.reset()
            if self._partial is not None:
                failed[id(self._partial)] = self._partial
                self._partial = None
            for admitted in failed.values():
                self.resolve(admitted.waiting.future, exc)

    def _admit(self, start_new: bool) -> None:
        gen = self.generator
        while True:
            admitted = self._partial
            if admitted is None:
                if not start_new or not self.inbox:
                    return
                waiting = self.inbox[0]
                if waiting.future.done():
                    self.inbox.popleft()
                    continue
                admitted = self._start(waiting)
                self.inbox.popleft()
                if admitted is None:
                    continue
            take, free_rows = 0, sum(seq is None for seq in gen.rows)
            blocks, free_blocks = 0, gen.cache.allocator.num_free
            specs = admitted.specs[admitted.next_spec :]
            while take < len(specs) and take < free_rows:
                blocks += gen.blocks_needed([specs[take]])
                if blocks > free_blocks:
                    break
                take += 1
            if take:
                first = admitted.next_spec
                tags = [(admitted, first + k) for k in range(take)]
                for seq in gen.add(specs[:take], tags=tags):
                    if gen.rows[seq.row] is not seq:  # finished on its first token
                        self._finished(seq.tag, seq.output)
                admitted.next_spec += take
            if admitted.next_spec < len(admitted.specs):
                self._partial = admitted
                return  # the rest joins as rows and blocks free up
            self._partial = None

    def _start(self, waiting: Waiting) -> _Admitted | None:
        """Bind a job to the version its slot serves now, or hand it back (resolved)."""
        job = waiting.job
        slot, version = bound_version(job, self.bank, self.full_weights())
        if version is None:
            self.resolve(waiting.future, SlotChanged(f"slot {job.slot} moved on from {job.run_id}"))
            return None
        specs = job_specs(job, slot)
        try:
            self.generator.check(specs, together=False)
        except ValueError as exc:
            self.resolve(waiting.future, exc)
            return None
        return _Admitted(waiting, version, specs, [None] * len(specs))

    def _finished(self, tag: Any, output: SequenceOutput) -> None:
        admitted, index = tag
        admitted.outputs[index] = output
        admitted.remaining -= 1
        if admitted.remaining == 0:
            outputs = [o if o is not None else SequenceOutput() for o in admitted.outputs]
            job = admitted.waiting.job
            self.resolve(admitted.waiting.future, job_result(job, admitted.version, outputs))
