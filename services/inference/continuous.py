"""The torch engine's generation loop: jobs join and leave between decode steps.

The worker thread runs :meth:`ContinuousLoop.serve` while there is work. Each turn it

1. applies staged adapters to every slot no unfinished sequence (and no half-admitted job)
   uses, so a swap never lands inside a job;
2. drops every job whose caller cancelled it or whose deadline passed, waiting or decoding:
   its rows and KV blocks are free at once, and its future says why;
3. admits waiting jobs, rollouts first and HTTP sampling in a bounded share, round-robin across
   tenants (schedule.py): a job's slot must still hold its run at a version the job accepts
   (else :class:`SlotChanged`), and its sequences join the decode batch as rows and KV blocks
   allow; a job bigger than what is free joins part by part (one such job per class at a
   time), its slot counting as busy until the last part is in, so every completion of a job
   comes from one policy version;
4. decodes one token for every row, and completes each job whose last sequence finished.

It returns when nothing is left, or when a full-weights install asks it to drain (starts no
new job, finishes what runs, and leaves the waiting jobs for the next turn).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schemas.events import Completion, PromptLogprobs, TopLogprobs
from services.inference.adapters import AdapterBank
from services.inference.jobs import (
    DeadlineExceeded,
    InstalledFullWeights,
    Job,
    JobResult,
    SlotChanged,
)
from services.inference.schedule import HTTP, ROLLOUT, HttpShare, WaitingJobs
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
        http_share: float = 1.0,
    ) -> None:
        self.generator = generator
        self.bank = bank
        self.full_weights = full_weights
        self.resolve = resolve
        self.inbox: deque[Waiting] = deque()
        """Jobs handed over by the event loop (appends there, pops here)."""
        self.waiting = WaitingJobs()
        """Jobs taken from the inbox, waiting for room in the batch (worker thread only)."""
        self.drain = threading.Event()
        """Set by a full-weights install: admit nothing more until it is cleared."""
        self.share = HttpShare.of(http_share, generator.max_seqs, generator.cache.num_blocks - 1)
        self._partial: dict[str, _Admitted] = {}
        """per class, the job whose sequences are joining part by part"""

    def pending(self) -> list[Waiting]:
        """Every job handed over and not admitted yet."""
        return [*self.inbox, *self.waiting]

    def _busy(self) -> set[int]:
        busy = self.generator.busy_slots
        busy.update(a.specs[0].slot for a in self._partial.values())
        return busy

    def serve(self) -> None:
        """Generate until no job is left (or a drain is asked for and what runs has finished)."""
        gen = self.generator
        first = True
        try:
            while True:
                while self.inbox:
                    self.waiting.add(self.inbox.popleft())
                self._drop_unwanted()
                self.bank.apply_staged(self._busy())
                # The jobs handed to this batch start even if a drain was asked for meanwhile
                # (they are what runs); draining, a half-admitted job gets the rest in too.
                self._admit(start_new=first or not self.drain.is_set())
                first = False
                if not gen.active:
                    if not self._partial and (
                        self.drain.is_set() or not (self.waiting or self.inbox)
                    ):
                        return
                    continue
                for seq in gen.step():
                    self._finished(seq.tag, seq.output)
        except Exception as exc:
            log.exception("generation failed; failing every job the engine held")
            failed = {id(s.tag[0]): s.tag[0] for s in gen.active}
            gen.reset()
            for admitted in self._partial.values():
                failed[id(admitted)] = admitted
            self._partial = {}
            for admitted in failed.values():
                self.resolve(admitted.waiting.future, exc)

    def _drop_unwanted(self) -> None:
        """Drop the jobs nobody waits for any more (cancelled futures) and those whose deadline
        has passed, waiting or decoding, freeing their rows and blocks."""
        now = time.time()

        def unwanted(waiting: Waiting) -> bool:
            deadline = waiting.job.deadline
            return waiting.future.done() or (deadline is not None and deadline <= now)

        for waiting in self.waiting.remove(unwanted):
            self._dropped(waiting)
        stopped: dict[int, tuple[_Admitted, list[Any]]] = {}
        for seq in self.generator.active:
            admitted = seq.tag[0]
            if unwanted(admitted.waiting):
                stopped.setdefault(id(admitted), (admitted, []))[1].append(seq)
        for source, admitted in list(self._partial.items()):
            if unwanted(admitted.waiting):
                del self._partial[source]
                stopped.setdefault(id(admitted), (admitted, []))
        for admitted, seqs in stopped.values():
            self.generator.release(seqs)
            self._dropped(admitted.waiting)

    def _dropped(self, waiting: Waiting) -> None:
        if not waiting.future.done():  # a cancelled job's future already says so
            job = waiting.job
            self.resolve(
                waiting.future,
                DeadlineExceeded(f"{job.request_id}: its deadline passed before it finished"),
            )

    def _admit(self, start_new: bool) -> None:
        self._admit_class(ROLLOUT, start_new)
        self._admit_class(HTTP, start_new)

    def _admit_class(self, source: str, start_new: bool) -> None:
        gen = self.generator
        while True:
            admitted = self._partial.pop(source, None)
            if admitted is None:
                if not start_new:
                    return
                waiting = self.waiting.pop(source)
                if waiting is None:
                    return
                if waiting.future.done():
                    continue
                admitted = self._start(waiting)
                if admitted is None:
                    continue
            free_rows, free_blocks = self._room(source)
            take, blocks = 0, 0
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
                self._partial[source] = admitted
                return  # the rest joins as rows and blocks free up

    def _room(self, source: str) -> tuple[int, int]:
        """The rows and KV blocks a job of ``source`` may take now: HTTP sampling up to its
        share; rollouts all that is free, less what HTTP sampling waiting for its share lacks."""
        gen = self.generator
        free_rows = sum(seq is None for seq in gen.rows)
        free_blocks = gen.cache.allocator.num_free
        held = [
            seq for seq in gen.rows if seq is not None and seq.tag[0].waiting.job.source == HTTP
        ]
        held_blocks = sum(len(seq.blocks) for seq in held)
        if source == HTTP:
            return self.share.room(len(held), held_blocks, free_rows, free_blocks)
        if not (self.waiting.http or HTTP in self._partial):
            return free_rows, free_blocks
        lacking_rows = max(0, self.share.rows - len(held))
        lacking_blocks = max(0, self.share.blocks - held_blocks)
        return max(0, free_rows - lacking_rows), max(0, free_blocks - lacking_blocks)

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
