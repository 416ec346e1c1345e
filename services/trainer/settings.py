"""The trainer's settings: one pydantic model, loaded by :func:`services.config.load_settings`.

Precedence, lowest first: defaults, ``--config FILE`` (TOML), ``PLEXRL_<FIELD>`` environment
variables (a list as ``PLEXRL_TARGET_MODULES=q_proj,v_proj``, a flag as
``PLEXRL_FULL_WEIGHTS=1``), then command-line flags. This module imports no torch, so
``plexrl trainer --help`` stays instant.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.config import DEFAULT_MAX_LORA_RANK
from services.config.fields import Token


def default_threads() -> int:
    """Half the cores this process may use, at least one.

    The trainer rarely has the machine to itself: ``plexrl up`` runs inference (torch too) and
    the orchestrators beside it. Measured on a 2-core machine with the bench model's batch
    (bench/trainer.py, 8 runs x 4 x 128 tokens, forward+backward): with the machine otherwise
    idle, 2 threads took 0.76 s; with one other busy process on it, 1 thread took 1.3 s and
    2 threads 25 s, because OpenMP's threads spin at every barrier while one of them waits for
    a core. Half the cores gives up under 2x when the machine is idle to never pay 20x when it
    is not; set ``threads`` to all cores on a machine that runs nothing else.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // 2)


class TrainerSettings(BaseModel):
    """Everything ``plexrl trainer`` can be told."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path = Field(
        description="Hugging Face model directory (`plexrl model tiny DIR` writes the default)"
    )
    output_dir: Path = Field(
        Path("outputs"),
        description="run directories: checkpoints go to {output_dir}/<run_id>/checkpoints/",
    )
    max_runs: int = Field(
        4, ge=1, le=4096, description="adapter slots; the same number as the registry's pool"
    )
    full_weights: bool = Field(
        False,
        description="train the model's own parameters instead of LoRA adapters, for one run "
        "(needs max_runs = 1); each step publishes the whole model (WeightsReady kind 'full'), "
        "max_lora_rank and target_modules are not used, and a run with loss.kl_coef > 0 is "
        "refused (there is no base model to compare with)",
    )
    max_lora_rank: int = Field(
        DEFAULT_MAX_LORA_RANK,
        ge=1,
        le=1024,
        description="largest LoRA rank a run may use (the slots' size)",
    )
    target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description="nn.Linear or Conv1D modules that carry adapters (names or name suffixes, "
        "as in PEFT); unset: the model family's default (every attention and MLP projection "
        "of a Llama, GPT-2's c_attn, c_proj and c_fc, ...)",
    )
    micro_batch_tokens: int = Field(
        8192, ge=16, le=1 << 24, description="padded tokens per micro-batch (rows * longest row)"
    )
    weight_transport: Literal["object_store", "filesystem", "ucx", "collective"] = Field(
        "object_store",
        description="how WeightsReady adapters travel: object_store, filesystem, ucx (needs "
        "the ucx extra) or collective (torch.distributed)",
    )
    ucx_host: str = Field(
        "127.0.0.1",
        min_length=1,
        max_length=253,
        description="ucx: the trainer's address as replicas reach it, written into each "
        "WeightsReady location (the listener accepts on every interface)",
    )
    ucx_port: int = Field(
        0, ge=0, le=65535, description="ucx: the listener's port; 0 takes any free one"
    )
    collective_host: str = Field(
        "127.0.0.1",
        min_length=1,
        max_length=253,
        description="collective: the address of the group's rendezvous on the trainer",
    )
    collective_port: int = Field(
        29510,
        ge=1,
        le=65535,
        description="collective: the rendezvous port; replicas join there at start-up, so it "
        "is fixed (not torchrun's 29500, which the trainer's own ranks may use)",
    )
    collective_bucket_bytes: int = Field(
        32 << 20,
        ge=1 << 10,
        le=1 << 34,
        description="collective: bytes broadcast at a time (tensors are packed into buckets)",
    )
    keep_weights: int = Field(
        3, ge=1, le=1000, description="adapter versions kept per run in the weight transport"
    )
    sharding: Literal["dp", "fsdp", "hybrid"] = Field(
        "dp",
        description="how torchrun ranks hold the model: dp, every rank the whole base model and "
        "every adapter slot; fsdp, the base model's layers and their slots sharded across all "
        "ranks (FSDP2); hybrid, sharded within a group of shard_ranks ranks (a node) and "
        "replicated across groups. A single process ignores it",
    )
    shard_ranks: int = Field(
        0,
        ge=0,
        le=4096,
        description="hybrid: ranks per shard group, a divisor of the world size; 0 takes "
        "torchrun's LOCAL_WORLD_SIZE, the ranks of one node",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the model runs")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="parameter and activation dtype"
    )
    threads: int = Field(
        0, ge=0, le=1024, description="torch intra-op threads; 0 means half the cores"
    )
    ack_wait: float = Field(
        300.0,
        gt=0,
        le=86400,
        description="seconds the server waits for an ack before redelivering a batch; held "
        "batches are kept alive with in-progress signals every ack_wait / 3",
    )
    collect_ms: float = Field(
        5.0,
        ge=0,
        le=10_000,
        description="once one batch is trainable, wait this long for other runs' batches",
    )
    unknown_run_hold: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="seconds a batch of a run the mirror does not know yet is held before it "
        "is handed back to the server (its RunDiscovered may still be on the way)",
    )
    consumer_name: Token = Field(
        "trainer", description="durable consumer on PLEXRL_ROLLOUTS; one per trainer deployment"
    )
    service: Token = Field(
        "trainer", description="service name: errors go to plexrl.errors.<service>"
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split_target_modules(cls, v: object) -> object:
        # PLEXRL_TARGET_MODULES arrives as one string: "q_proj,v_proj" or "q_proj v_proj".
        return [t for t in re.split(r"[,\s]+", v) if t] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _full_weights_fit(self) -> TrainerSettings:
        if self.full_weights and self.max_runs != 1:
            raise ValueError(
                f"full_weights trains the model's own parameters for one run, so it needs "
                f"max_runs = 1 (got {self.max_runs}); set --max-runs 1, and the registry's "
                "max_runs to 1 as well"
            )
        if self.full_weights and self.sharding != "dp":
            raise ValueError(
                f"full_weights trains one run's whole model, which sharding = {self.sharding!r} "
                "does not shard (only a LoRA trainer's base model and slots are sharded); use "
                "sharding = 'dp', or train the run with LoRA"
            )
        return self

    @property
    def num_threads(self) -> int:
        return self.threads or default_threads()
