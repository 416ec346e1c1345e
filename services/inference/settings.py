"""The inference service's settings: one pydantic model, loaded by ``load_settings``.

Precedence, lowest first: defaults, ``--config FILE`` (TOML), ``PLEXRL_<FIELD>`` environment
variables (``PLEXRL_MODEL``, ``PLEXRL_MAX_RUNS``, ``PLEXRL_TARGET_MODULES`` as a comma-separated
list...), then command-line flags.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.config import DEFAULT_MAX_LORA_RANK
from services.config.fields import Token64


def default_replica_name() -> str:
    """``<host>-<pid>``, reduced to the characters a subject token or header value allows."""
    raw = f"{socket.gethostname()}-{os.getpid()}"
    return re.sub(r"[^A-Za-z0-9_-]", "_", raw)[-64:]


class InferenceSettings(BaseModel):
    """Everything ``plexrl inference`` can be told."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["torch", "vllm"] = Field(
        "torch", description="'torch' (CPU or GPU, multi-LoRA batches) or 'vllm' (GPU)"
    )
    model: Path = Field(
        ..., description="Hugging Face model directory (`plexrl model tiny DIR` writes one)"
    )
    max_runs: int = Field(4, ge=1, le=4096, description="adapter slots: the registry's max_runs")
    max_snapshots: int = Field(
        8,
        ge=0,
        le=4096,
        description="adapter slots beyond the runs' that keep exact versions for sampling "
        "clients of saved weights (run_x@N); the least recently used is dropped for a new one",
    )
    max_lora_rank: int = Field(
        DEFAULT_MAX_LORA_RANK,
        ge=1,
        le=1024,
        description="largest LoRA rank a run's adapter may have",
    )
    target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description="module names that carry LoRA adapters; must match the trainer's (unset "
        "on both: the model family's default)",
    )
    output_dir: Path = Field(
        Path("outputs"),
        description="run directories; filesystem-transport weights are read only from here",
    )
    batch_window_ms: float = Field(
        5.0, ge=0, le=10_000, description="how long the first request of a batch waits for more"
    )
    max_batch_tokens: int = Field(
        16384,
        ge=16,
        le=10_000_000,
        description="prompt plus completion tokens of one batch (its KV cache), at most",
    )
    max_request_tokens: int = Field(
        1 << 22,
        ge=1,
        le=1 << 40,
        description="largest generation one request may ask for: prompts x n x max_tokens; a "
        "bigger request is refused with an error saying so",
    )
    max_http_requests: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="HTTP sampling requests (the gateway's) this replica holds at once, waiting "
        "or generating; one more is refused at once as overloaded (the gateway answers 429 "
        "with Retry-After). Rollouts are never refused by it",
    )
    max_http_tokens: int = Field(
        1 << 20,
        ge=1,
        le=1 << 40,
        description="prompt plus completion tokens (n x (prompt + max_tokens) per request) of "
        "the HTTP sampling this replica holds at once; past it a request is refused as "
        "overloaded",
    )
    http_share: float = Field(
        0.25,
        gt=0.0,
        le=1.0,
        description="torch engine: the most of the batch's rows and KV cache HTTP sampling may "
        "hold; rollouts are admitted first and keep the rest, so public load slows RL runs by a "
        "bounded share (1: no reserve, for a replica that serves HTTP sampling only)",
    )
    overload_retry_after_s: float = Field(
        1.0,
        gt=0.0,
        le=3600.0,
        description="the retry_after_s an overloaded refusal carries (the gateway's Retry-After)",
    )
    max_num_seqs: int = Field(
        256,
        ge=1,
        le=4096,
        description="torch engine: sequences decoded at once (rows of the continuous batch)",
    )
    paged: bool = Field(
        True,
        description="torch engine: continuous batching over a paged KV cache for the families "
        "it runs (Llama, Mistral, Qwen2, Qwen3); false: static batches for every model",
    )
    cuda_graphs: bool = Field(
        True, description="torch engine on a GPU: replay each decode step as a CUDA graph"
    )
    threads: int = Field(0, ge=0, le=1024, description="torch CPU threads; 0 keeps torch's default")
    device: str = Field("auto", description="'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1'")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="model dtype: 'auto' is float32 on CPU and bfloat16 on GPU"
    )
    replica_name: Token64 = Field(
        default_factory=default_replica_name,
        description="this replica's name, sent in the Plexrl-Replica reply header (default "
        "<host>-<pid>)",
    )
    service: Token64 = Field(
        "inference", description="service name: errors go to plexrl.errors.<service>"
    )
    weight_load_attempts: int = Field(
        2, ge=1, le=10, description="tries per announced adapter before it is given up"
    )
    weight_transport: Literal["object_store", "filesystem", "ucx", "collective"] = Field(
        "object_store",
        description="the trainer's weight transport: 'collective' joins its broadcast group at "
        "start-up; every WeightsReady is still read as its own transport says",
    )
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1.0, description="vllm: fraction of GPU memory the engine may take"
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split_target_modules(cls, v: object) -> object:
        # PLEXRL_TARGET_MODULES arrives as one string: "q_proj,v_proj" or "q_proj v_proj".
        return [t for t in re.split(r"[,\s]+", v) if t] if isinstance(v, str) else v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", v):
            raise ValueError(f"{v!r} is not a device: use auto, cpu, cuda, cuda:N or mps")
        return v

    def torch_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def torch_dtype(self) -> Any:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)
