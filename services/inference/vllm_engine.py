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

Log-probabilities come from ``logprobs=1`` with the engine's ``logprobs_mode`` set to
``processed_logprobs`` (vLLM >= 0.10.2): the log-probability of each sampled token after
temperature and top-p, the torch engine's semantics. Temperature 0 reports 0.0, as there.

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
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from schemas.events import Completion, WeightsReady
from services.inference.jobs import InstalledFullWeights, Job, JobResult, LoadInto, SlotChanged
from services.model.peft_io import write_peft_dir
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
    ) -> None:
        self.model_dir = Path(model_dir)
        self.max_runs = max_runs
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
            max_loras=self.max_runs,
            max_cpu_loras=2 * self.max_runs,
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
        if gone is not None:
            shutil.rmtree(self.adapter_root / gone.run_id, ignore_errors=True)
        self._listener()

    def available_version(self, slot: int, run_id: str) -> int | None:
        held = self._runs.get(slot)
        return held.version if held is not None and held.run_id == run_id else None

    async def load_adapter(
        self, slot: int, event: WeightsReady, tensors: dict[str, torch.Tensor]
    ) -> bool:
        from vllm.lora.request import LoRARequest

        held = self._runs.get(slot)
        if held is None or held.run_id != event.run_id or held.version >= event.step:
            return False
        if event.lora.rank > self.max_lora_rank:
            raise ValueError(f"adapter rank {event.lora.rank} exceeds --max-lora-rank")
        if event.transport == "filesystem":
            directory, written = Path(event.location), None
        else:
            written = self.adapter_root / event.run_id / f"step_{event.step}"
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
        current = self._runs.get(slot)
        if current is None or current.run_id != event.run_id or current.version >= event.step:
            return False
        self._runs[slot] = _RunAdapter(event.run_id, event.step, current.rank, request, written)
        if current.directory is not None and current.directory != written:
            # Requests still running on the old version hold it in vLLM's memory already.
            await asyncio.to_thread(shutil.rmtree, current.directory, True)
        self._listener()
        return True

    async def install_full(self, event: WeightsReady, load: LoadInto) -> bool:
        raise ValueError(
            f"the vllm engine cannot install full model weights yet ({event.run_id} at step "
            f"{event.step} was announced as kind 'full'): serve a trainer started with "
            "--full-weights with --engine torch"
        )

    # --- generation --------------------------------------------------------------------------

    async def generate(self, job: Job) -> JobResult:
        held = self._runs.get(job.slot)
        if held is None or held.run_id != job.run_id or held.version < job.min_version:
            raise SlotChanged(f"slot {job.slot} moved on from {job.run_id}")
        flat = await asyncio.gather(
            *(
                self._one(job, prompt, sequence_seed(job.seed, i, j), held.lora)
                for i, prompt in enumerate(job.prompts)
                for j in range(job.n)
            )
        )
        groups = [flat[i * job.n : (i + 1) * job.n] for i in range(len(job.prompts))]
        return JobResult(policy_version=held.version, completions=[list(g) for g in groups])

    async def _one(self, job: Job, prompt: list[int], seed: int, lora: Any) -> Completion:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1,
            temperature=job.temperature,
            top_p=job.top_p,
            max_tokens=job.max_tokens,
            seed=seed,
            logprobs=1,
            stop_token_ids=self.eos_ids,
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
        return Completion(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason="stop" if out.finish_reason == "stop" else "length",
        )


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
