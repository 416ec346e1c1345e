"""The ``vllm`` engine (GPU): the service's Engine interface on vLLM's ``AsyncLLMEngine``.

vLLM batches continuously on its own, so every sequence of a job goes straight to it as one
request with its own seed (the same per-sequence seeds as the torch engine derives), and the
service's waiting and versioning stay as they are. One ``LoRARequest`` per run and version:

- version 0 of a run is the base model (no LoRA request at all);
- a new version gets a fresh ``lora_int_id`` (vLLM caches adapters by id) and is pre-loaded
  with ``add_lora`` before it is announced as available, so the first request does not pay for
  it. Requests already running keep the adapter they started with; vLLM's LRU evicts old ones.
- its directory is the PEFT directory of the filesystem transport as announced, or one written
  here (``services.model.peft_io.write_peft_dir``) from the tensors fetched from the object
  store.

Log-probabilities come from ``logprobs`` with the engine's ``logprobs_mode`` set to
``processed_logprobs`` (vLLM >= 0.10.2): the log-probability of each sampled token after
temperature, top-k and top-p, the torch engine's semantics. Temperature 0 reports 0.0, as there.
A request's alternatives are vLLM's ``logprobs`` (ranked), its prompt scores vLLM's
``prompt_logprobs``, its ``top_k`` and ``ignore_eos`` vLLM's own parameters; a base-model
request (no run) carries no LoRA request.

Exact versions (``run_x@N``) are kept as snapshots: the LoRA request of a version a request
pinned stays registered (and its directory on disk) after the run moves on, up to
``max_snapshots`` of them, the least recently used dropped first.

Full model weights (``WeightsReady.kind == "full"``, a trainer started with ``--full-weights``)
are not supported by this engine yet: :meth:`VllmEngine.install_full` refuses them with an error
the weights follower reports, and the replica keeps serving what it served.

vllm is imported only when this engine starts; without it (or without a GPU) the CLI refuses
``--engine vllm`` with :func:`vllm_unavailable_reason` and its tests are skipped.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import shutil
import uuid
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from schemas.events import Completion, PromptLogprobs, TopLogprobs, WeightsReady
from services.inference.jobs import InstalledFullWeights, Job, JobResult, LoadInto, SlotChanged
from services.model.peft_io import write_peft_dir
from services.model.routing import NO_ADAPTER
from services.model.sampling import sequence_seed

_VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def vllm_unavailable_reason() -> str:
    """Why the vllm engine cannot run here ("" when it can)."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install 'plexrl[vllm]')"
    if not torch.cuda.is_available():
        return "vllm needs a CUDA GPU and none is visible"
    return ""


@dataclass(frozen=True)
class _RunAdapter:
    run_id: str
    version: int
    rank: int
    lora: Any = None  # vllm.lora.request.LoRARequest; None serves the base model
    directory: Path | None = None


class VllmEngine:
    """Engine on vLLM: continuous batching, one LoRA adapter per run and version."""

    def __init__(
        self,
        model_dir: Path,
        *,
        max_runs: int,
        max_lora_rank: int,
        output_dir: Path,
        replica_name: str,
        gpu_memory_utilization: float = 0.85,
        dtype: str = "auto",
        max_snapshots: int = 0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.max_runs = max_runs
        self.max_snapshots = max_snapshots
        self._snapshots: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.max_lora_rank = max_lora_rank
        self.adapter_root = Path(output_dir) / ".inference-adapters" / replica_name
        self.gpu_memory_utilization = gpu_memory_utilization
        self.dtype = dtype
        self._runs: dict[int, _RunAdapter] = {}
        self.full_weights: InstalledFullWeights | None = None  # never set: full weights are refused
        self.write_guard: AbstractContextManager[Any] | None = None
        self._lora_ids = itertools.count(1)
        self._listener: Callable[[], None] = lambda: None
        self.llm: Any = None
        config = json.loads((self.model_dir / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.max_model_len = int(config.get("max_position_embeddings") or 4096)
        self.eos_ids = _eos_ids(self.model_dir, config)

    async def start(self) -> None:
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        rank = next((r for r in _VLLM_LORA_RANKS if r >= self.max_lora_rank), self.max_lora_rank)
        args = AsyncEngineArgs(
            model=str(self.model_dir),
            dtype=self.dtype,
            enable_lora=True,
            max_loras=self.max_runs + self.max_snapshots,
            max_cpu_loras=2 * (self.max_runs + self.max_snapshots),
            max_lora_rank=rank,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            seed=0,
        )
        self.llm = AsyncLLMEngine.from_engine_args(args)

    async def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        shutil.rmtree(self.adapter_root, ignore_errors=True)

    def set_listener(self, listener: Callable[[], None]) -> None:
        self._listener = listener

    # --- adapters ----------------------------------------------------------------------------

    def add_run(self, slot: int, run_id: str, rank: int, alpha: float) -> None:
        if rank > self.max_lora_rank:
            raise ValueError(
                f"{run_id} asks for LoRA rank {rank} but this replica holds adapters up to rank "
                f"{self.max_lora_rank}: restart inference with --max-lora-rank {rank} or more"
            )
        self._runs[slot] = _RunAdapter(run_id, 0, rank)
        self._listener()

    def remove_run(self, slot: int, run_id: str) -> None:
        gone = self._runs.pop(slot, None)
        for key in [k for k in self._snapshots if k[0] == run_id]:
            self._runs.pop(self._snapshots.pop(key), None)
        if gone is not None:
            shutil.rmtree(self.adapter_root / gone.run_id, ignore_errors=True)
        self._listener()

    def snapshot_slot(self, run_id: str, version: int) -> int | None:
        slot = self._snapshots.get((run_id, version))
        if slot is not None:
            self._snapshots.move_to_end((run_id, version))
        return slot

    async def pin(
        self,
        slot: int,
        run_id: str,
        version: int,
        event: WeightsReady | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
    ) -> int | None:
        if self.max_snapshots == 0:
            return None
        held = self.snapshot_slot(run_id, version)
        if held is not None:
            return held
        live = self._runs.get(slot)
        if tensors is None or event is None:
            if live is None or live.run_id != run_id or live.version != version:
                return None
            adapter = live
        else:
            adapter = await self._register(event, tensors, f"snapshot_{event.step}")
        taken = set(self._snapshots.values())
        span = range(self.max_runs, self.max_runs + self.max_snapshots)
        free = [s for s in span if s not in taken]
        if free:
            pinned = free[0]
        else:
            _, pinned = self._snapshots.popitem(last=False)
            dropped = self._runs.pop(pinned, None)
            if dropped is not None and dropped.directory is not None:
                await asyncio.to_thread(shutil.rmtree, dropped.directory, True)
        self._runs[pinned] = adapter
        self._snapshots[(run_id, version)] = pinned
        return pinned

    def available_version(self, slot: int, run_id: str) -> int | None:
        held = self._runs.get(slot)
        return held.version if held is not None and held.run_id == run_id else None

    async def load_adapter(
        self, slot: int, event: WeightsReady, tensors: dict[str, torch.Tensor]
    ) -> bool:
        held = self._runs.get(slot)
        if held is None or held.run_id != event.run_id or held.version >= event.step:
            return False
        if event.lora.rank > self.max_lora_rank:
            raise ValueError(f"adapter rank {event.lora.rank} exceeds --max-lora-rank")
        adapter = await self._register(event, tensors, f"step_{event.step}")
        current = self._runs.get(slot)
        if current is None or current.run_id != event.run_id or current.version >= event.step:
            return False
        self._runs[slot] = adapter
        pinned = {self._runs[s].directory for s in self._snapshots.values() if s in self._runs}
        old = current.directory
        if old is not None and old not in (adapter.directory, *pinned):
            # Requests still running on the old version hold it in vLLM's memory already.
            await asyncio.to_thread(shutil.rmtree, old, True)
        self._listener()
        return True

    async def _register(
        self, event: WeightsReady, tensors: dict[str, torch.Tensor], name: str
    ) -> _RunAdapter:
        """Register ``event``'s adapter with vLLM under a fresh LoRA id."""
        from vllm.lora.request import LoRARequest

        if event.transport == "filesystem" and name.startswith("step_"):
            directory, written = Path(event.location), None
        else:
            written = self.adapter_root / event.run_id / name
            directory = await asyncio.to_thread(
                write_peft_dir,
                written,
                tensors,
                event.lora.rank,
                event.lora.alpha,
                event.lora.target_modules,
                fan_in_fan_out=event.lora.fan_in_fan_out,
            )
        request = LoRARequest(
            f"{event.run_id}@{event.step}", next(self._lora_ids), lora_path=str(directory)
        )
        try:
            await self.llm.add_lora(request)
        except Exception as exc:  # vLLM says why it cannot load it: shape, rank, modules
            raise ValueError(f"vLLM refused the adapter: {exc}") from exc
        return _RunAdapter(event.run_id, event.step, event.lora.rank, request, written)

    async def install_full(self, event: WeightsReady, load: LoadInto) -> bool:
        raise ValueError(
            f"the vllm engine cannot install full model weights yet ({event.run_id} at step "
            f"{event.step} was announced as kind 'full'): serve a trainer started with "
            "--full-weights with --engine torch"
        )

    # --- generation --------------------------------------------------------------------------

    async def generate(self, job: Job) -> JobResult:
        held = _RunAdapter(job.run_id, 0, 0) if job.slot == NO_ADAPTER else self._runs.get(job.slot)
        if (
            held is None
            or held.run_id != job.run_id
            or held.version < job.min_version
            or (job.exact and held.version != job.min_version)
        ):
            raise SlotChanged(f"slot {job.slot} moved on from {job.run_id}")
        flat = await asyncio.gather(
            *(
                self._one(job, prompt, sequence_seed(job.seed, i, j), held.lora, j == 0)
                for i, prompt in enumerate(job.prompts)
                for j in range(job.n)
            )
        )
        groups = [flat[i * job.n : (i + 1) * job.n] for i in range(len(job.prompts))]
        scores = [g[0][1] for g in groups if g[0][1] is not None]
        return JobResult(
            policy_version=held.version,
            completions=[[c for c, _ in g] for g in groups],
            prompt_logprobs=scores,
        )

    async def _one(
        self, job: Job, prompt: list[int], seed: int, lora: Any, first: bool
    ) -> tuple[Completion, PromptLogprobs | None]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        scored = job.prompt_logprobs and first
        params = SamplingParams(
            n=1,
            temperature=job.temperature,
            top_p=job.top_p,
            top_k=job.top_k if job.top_k > 0 else -1,
            max_tokens=job.max_tokens,
            seed=seed,
            logprobs=max(1, job.top_logprobs),
            prompt_logprobs=job.top_logprobs if scored else None,
            ignore_eos=job.ignore_eos,
            stop_token_ids=[] if job.ignore_eos else self.eos_ids,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        async for output in self.llm.generate(
            {"prompt_token_ids": prompt},
            params,
            f"{job.request_id}-{uuid.uuid4().hex}",
            lora_request=lora,
        ):
            final = output
        if final is None:
            raise RuntimeError(f"vLLM returned nothing for {job.request_id}")
        out = final.outputs[0]
        token_ids = [int(t) for t in out.token_ids]
        if job.temperature == 0.0:
            logprobs = [0.0] * len(token_ids)
        else:
            logprobs = [float(d[t].logprob) for d, t in zip(out.logprobs, token_ids, strict=True)]
        top = [_ranked(d, job.top_logprobs) for d in out.logprobs] if job.top_logprobs else []
        completion = Completion(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason="stop" if out.finish_reason == "stop" else "length",
            top_logprobs=top,
        )
        if not scored:
            return completion, None
        given = final.prompt_logprobs or []
        scores: list[float | None] = [None]
        alternatives = [TopLogprobs(token_ids=[], logprobs=[])]
        for t, entry in enumerate(given[1:], start=1):
            scores.append(float(entry[prompt[t]].logprob) if entry else None)
            alternatives.append(_ranked(entry or {}, job.top_logprobs))
        return completion, PromptLogprobs(
            logprobs=scores, top_logprobs=alternatives if job.top_logprobs else []
        )


def _ranked(entry: dict[int, Any], k: int) -> TopLogprobs:
    """The ``k`` best-ranked tokens of one position of vLLM's logprobs (it adds the chosen
    token whatever its rank: left out here when it is not among the ``k``)."""
    best = sorted(
        ((int(getattr(v, "rank", 0) or 0), t, float(v.logprob)) for t, v in entry.items()),
        key=lambda r: r[0],
    )
    kept = [(t, lp) for rank, t, lp in best if 1 <= rank <= k][:k]
    return TopLogprobs(token_ids=[t for t, _ in kept], logprobs=[lp for _, lp in kept])


def _eos_ids(model_dir: Path, config: dict[str, Any]) -> list[int]:
    ids: set[int] = set()
    sources = [config]
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        sources.append(json.loads(generation.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    # a chat model's turn ends at its template's end-of-turn token, as in the torch engine
    from transformers import AutoTokenizer

    from services.envs import end_of_turn_ids

    ids.update(end_of_turn_ids(AutoTokenizer.from_pretrained(model_dir)))
    return sorted(ids)
