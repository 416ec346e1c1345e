"""Helpers of the orchestrator tests: a scripted inference replica, stream and metrics readers.

:class:`ScriptedReplica` is a real NATS service in the ``inference`` queue group that answers
GenerateRequests the way a partly trained model would, so rewards are known in advance: sample
``k`` of a ``reverse`` prompt is the first ``k`` characters of the right answer, then <eos>.
Its policy version follows the WeightsReady announcements of the run, like a real replica that
loads each adapter, and it refuses a request whose ``min_policy_version`` it does not have yet
with the error a real replica sends ("... not loaded yet"). The tests that need a model use the
real inference service instead (test_orch_inference.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.msg import Msg
from nats.js import api

from schemas.codec import decode, encode
from schemas.events import (
    Completion,
    FinishReason,
    GenerateProgress,
    GenerateRequest,
    GenerateResponse,
    RolloutBatch,
    WeightsReady,
)
from schemas.subjects import (
    GENERATE,
    INFERENCE_QUEUE_GROUP,
    ROLLOUTS_STREAM,
    WEIGHTS_STREAM,
    rollouts_subject,
    weights_subject,
)
from services.bus import Bus, flushed
from services.model.tokenizer import EOS_TOKEN, character_vocab

T = TypeVar("T")
VOCAB = character_vocab()
ID_TO_CHAR = {i: c for c, i in VOCAB.items()}
EOS = VOCAB[EOS_TOKEN]


def answer_prefix_completion(prompt_ids: list[int], k: int, max_tokens: int) -> Completion:
    """The first ``k`` characters of the reversed word in ``reverse: word=``, then <eos>."""
    text = "".join(ID_TO_CHAR.get(i, "") for i in prompt_ids if i > 3)
    word = text.removeprefix("reverse: ").removesuffix("=")
    ids = [VOCAB[c] for c in word[::-1][:k]]
    reason: FinishReason
    if len(ids) < max_tokens:
        ids.append(EOS)
        reason = "stop"
    else:
        ids = ids[:max_tokens]
        reason = "length"
    return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=reason)


class ScriptedReplica:
    """A stand-in inference replica; see the module docstring."""

    def __init__(self, bus: Bus, run_id: str, *, delay: float = 0.0) -> None:
        self.bus = bus
        self.run_id = run_id
        self.delay = delay
        self.version = 0
        self.requests: list[GenerateRequest] = []
        self.refusals = 0
        self.errors: list[str] = []
        """error replies to send first, one per request, before answering normally"""
        self.holds = 0
        """requests to take, announce once on their progress_subject and never answer, as a
        replica killed while holding them would"""
        self.drops = 0
        """requests to take and never answer nor announce, as a replica killed the moment it
        took them would"""
        self._subs: list[Any] = []

    async def start(self) -> ScriptedReplica:
        self._subs.append(
            await self.bus.nc.subscribe(GENERATE, queue=INFERENCE_QUEUE_GROUP, cb=self._on_request)
        )
        self._subs.append(
            await self.bus.js.subscribe(
                weights_subject(self.run_id),
                stream=WEIGHTS_STREAM,
                cb=self._on_weights,
                ordered_consumer=True,
                deliver_policy=api.DeliverPolicy.ALL,
            )
        )
        await flushed(self.bus.nc)  # the server knows the subscriptions once this returns
        return self

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
        await flushed(self.bus.nc)  # the server has dropped them once this returns

    async def _on_weights(self, msg: Msg) -> None:
        self.version = max(self.version, decode(msg.data, WeightsReady).step)

    async def _on_request(self, msg: Msg) -> None:
        request: GenerateRequest = decode(msg.data, GenerateRequest)
        self.requests.append(request)
        if self.drops:
            self.drops -= 1
            return
        if self.holds:
            self.holds -= 1
            if request.progress_subject is not None:
                progress = GenerateProgress(
                    request_id=request.request_id,
                    run_id=request.run_id,
                    replica="scripted",
                    state="waiting_for_version",
                )
                await self.bus.nc.publish(request.progress_subject, encode(progress))
            return
        if self.delay:
            await asyncio.sleep(self.delay)
        error = None
        if self.errors:
            error = self.errors.pop(0)
        elif request.min_policy_version > self.version:
            self.refusals += 1
            error = (
                f"policy version {request.min_policy_version} of {request.run_id} not loaded yet "
                f"(have {self.version})"
            )
        completions = []
        if error is None:
            completions = [
                [answer_prefix_completion(p, k, request.max_tokens) for k in range(request.n)]
                for p in request.prompts
            ]
        response = GenerateResponse(
            request_id=request.request_id,
            run_id=request.run_id,
            policy_version=self.version,
            completions=completions,
            error=error,
        )
        await msg.respond(encode(response))


async def rollout_batches(bus: Bus, run_id: str) -> list[RolloutBatch]:
    """Every RolloutBatch stored for ``run_id``, in stream order (duplicates included)."""
    info = await bus.js.stream_info(ROLLOUTS_STREAM)
    subject = rollouts_subject(run_id)
    out: list[RolloutBatch] = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            raw = await bus.js.get_msg(ROLLOUTS_STREAM, seq)
        except Exception:  # a deleted message
            continue
        if raw.subject == subject:
            out.append(decode(raw.data or b"", RolloutBatch))
    return out


async def published_steps(bus: Bus, run_id: str) -> list[int]:
    return [b.step for b in await rollout_batches(bus, run_id)]


async def eventually(check: Callable[[], Awaitable[T]], timeout: float = 15.0) -> T:
    """Poll ``check`` until it returns a truthy value; fail with the last value after timeout."""
    deadline = time.monotonic() + timeout
    value = await check()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value {value!r})")
        await asyncio.sleep(0.05)
        value = await check()
    return value


def fake_weights(run_id: str, step: int, idx: int = 0) -> WeightsReady:
    """An announcement of version ``step`` (no blob behind it: only the scripted replica and
    the orchestrator's version bookkeeping read it)."""
    return WeightsReady(
        run_id=run_id,
        idx=idx,
        step=step,
        transport="object_store",
        location=f"{run_id}/step_{step}",
        digest="sha256:" + "0" * 64,
        size_bytes=0,
        lora={"rank": 8, "alpha": 16.0, "target_modules": ["q_proj"]},  # type: ignore[arg-type]
    )


async def announce(bus: Bus, run_id: str, step: int) -> None:
    await bus.publish(
        weights_subject(run_id), fake_weights(run_id, step), msg_id=f"{run_id}/w/{step}"
    )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl as its readers take it: the last line of each step, in step order,
    skipping lines that are not JSON objects with an integer ``step`` (a line cut by a crash)."""
    by_step: dict[int, dict[str, Any]] = {}
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]
