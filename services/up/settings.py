"""Settings of ``plexrl up``: how many demo runs, how long, and the run config they share."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.config import OrchConfig, orch_config_from_dict
from services.config import process_settings
from services.up.sweep import SweepRun, SweepSpec, distinct_ids, expand, sweep_name

DEMO_ENVS = ("reverse", "copy", "upper")
FULL_WEIGHTS_LR = 3e-4


def default_cache_dir() -> Path:
    """``PLEXRL_CACHE_DIR``, else ``XDG_CACHE_HOME``, else ``~/.cache``; then ``plexrl``."""
    base = process_settings().cache_dir or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "plexrl" if base else Path.home() / ".cache" / "plexrl"


class UpSettings(BaseModel):
    """``plexrl up``: flags override the ``--config`` TOML, which overrides these defaults."""

    model_config = ConfigDict(extra="forbid")

    output_dir: Path | None = Field(None, description="default: ./outputs/up-<timestamp>")
    runs: int = Field(3, ge=1, le=16, description="demo runs, cycling through the envs")
    steps: int = Field(40, ge=1, le=100_000, description="RL steps per run")
    max_async_level: int = Field(
        1, ge=0, le=16, description="steps generation may run ahead of training"
    )
    envs: list[str] = Field(
        default_factory=lambda: list(DEMO_ENVS),
        description="environments the demo runs cycle through",
    )
    model: Path | None = Field(
        None, description="a Hugging Face model dir; default: the cached warm-started tiny model"
    )
    max_runs: int = Field(4, ge=1, le=64, description="adapter slots in trainer and inference")
    trainer_threads: int = Field(1, ge=1, le=256, description="the trainer's torch threads")
    inference_threads: int = Field(1, ge=1, le=256, description="inference's torch threads")
    weight_transport: Literal["object_store", "filesystem", "ucx", "collective"] = Field(
        "object_store", description="how the trainer's adapters reach inference"
    )
    full_weights: bool = Field(
        False,
        description="train the model's own weights (no LoRA): one run, full state dicts to inference",
    )
    device: Literal["cpu", "cuda"] | None = Field(
        None, description="where trainer and inference run (default: their own defaults)"
    )
    live: bool = Field(True, description="show the live table (off when stdout is not a terminal)")
    max_restarts: int = Field(
        5,
        ge=0,
        le=1000,
        description="restarts of a crashed service within restart_window_s, with exponential "
        "backoff from 1 s, before plexrl up gives up and stops everything (0: never restart)",
    )
    restart_window_s: float = Field(
        600.0, gt=0, le=86_400, description="the window max_restarts counts crashes in"
    )
    health_interval_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="seconds between health pings of the services; one that has answered and "
        "then misses health_misses in a row is killed and restarted (0: no pings)",
    )
    health_misses: int = Field(
        3, ge=1, le=100, description="health pings missed in a row that make a service hung"
    )
    gateway: bool = Field(
        False,
        description="also start the HTTP gateway (Tinker and OpenAI APIs); then no demo runs "
        "start unless --runs is given, and everything serves until Ctrl-C",
    )
    gateway_port: int = Field(8000, ge=0, le=65535, description="the gateway's HTTP port")
    gateway_max_lora_rank: int = Field(
        64,
        ge=1,
        le=1024,
        description="with the gateway: the largest LoRA rank a training client may ask for "
        "(Tinker's default is 32); registry, trainer and inference are sized for it",
    )
    gateway_train_unembed: bool = Field(
        True,
        description="with the gateway: put LoRA on the unembedding (lm_head) too, as Tinker's "
        "train_unembed=True (its default) asks",
    )
    model_name: str = Field(
        "",
        max_length=256,
        description="with the gateway: the name the base model is served under, e.g. its "
        "Hugging Face id (default: the model directory)",
    )
    run: dict[str, Any] = Field(
        default_factory=dict,
        description="orch.toml keys applied to every demo run (e.g. [run.optim] lr = 2e-3)",
    )
    sweep: SweepSpec | None = Field(
        None,
        description="a [sweep] table: runs of the first env over a grid of orch.toml keys "
        "(replaces the demo runs; see services/up/sweep.py)",
    )

    @model_validator(mode="after")
    def _one_run_for_full_weights(self) -> UpSettings:
        if self.full_weights and "runs" not in self.model_fields_set:
            self.runs = 1
        if self.full_weights and self.runs != 1:
            raise ValueError(
                f"full_weights trains one run's whole model, so it takes runs = 1 (got {self.runs})"
            )
        if self.full_weights and self.sweep is not None:
            raise ValueError("full_weights trains one run, so it takes no [sweep] table")
        return self

    @property
    def slots(self) -> int:
        """Run slots of the registry, trainer and inference: one under full weights; a sweep's
        runs beyond ``max_runs`` wait in the registry's queue."""
        if self.full_weights:
            return 1
        if self.sweep is not None or (self.gateway and "runs" not in self.model_fields_set):
            return self.max_runs  # the gateway's clients bring their own runs
        return max(self.max_runs, self.runs)

    @property
    def sweep_name(self) -> str | None:
        if self.sweep is None:
            return None
        return self.sweep.name or sweep_name(self.envs[0])

    def planned_runs(self) -> list[SweepRun]:
        """Every run ``plexrl up`` (or ``plexrl sweep``) trains, with a distinct id each: the
        sweep's runs, or one demo run per ``runs`` cycling through ``envs``. Raises
        :class:`ConfigError` before anything starts."""
        if self.sweep is not None:
            return expand(self.sweep, self.run_config_dict(self.envs[0], 0), self.envs[0])
        if self.gateway and "runs" not in self.model_fields_set:
            return []  # the gateway's clients bring their own runs
        envs = [self.envs[i % len(self.envs)] for i in range(self.runs)]
        return [
            SweepRun(run_id, self.run_config(env, seed))
            for seed, (run_id, env) in enumerate(zip(distinct_ids(envs), envs, strict=True))
        ]

    def run_config(self, env: str, seed: int) -> OrchConfig:
        """The config of one demo run: tuned defaults, then ``[run]`` overrides, then the flags."""
        return orch_config_from_dict(self.run_config_dict(env, seed))

    def run_config_dict(self, env: str, seed: int) -> dict[str, Any]:
        """:meth:`run_config` before validation."""
        base: dict[str, Any] = {
            "env": env,
            "seed": seed,
            "max_steps": self.steps,
            "max_async_level": self.max_async_level,
            "batch_size": 8,
            "group_size": 8,
            "model": {"lora": {"rank": 8, "alpha": 16.0}},
            # Full fine-tuning moves every weight, so it takes a much smaller step than LoRA.
            "optim": {"lr": FULL_WEIGHTS_LR if self.full_weights else 2e-3},
            "sampling": {"temperature": 1.0, "max_tokens": 10},
            "ckpt": {"interval": 10},
            # Held-out evaluation every 20 steps and after the last (the base once, before the
            # first): about a tenth of the run's generation at the default 40 steps.
            "eval": {"interval": 20},
        }
        pinned = {"env": env, "max_steps": self.steps, "max_async_level": self.max_async_level}
        return _deep_merge(base, self.run) | pinned


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out
