"""The registry's settings: one pydantic model, loaded by :func:`services.config.load_settings`.

Precedence, lowest first: defaults, ``--config FILE`` (TOML), ``PLEXRL_<FIELD>`` environment
variables (``PLEXRL_OUTPUT_DIR``, ``PLEXRL_MAX_RUNS``, ``PLEXRL_TENANTS_FILE``,
``PLEXRL_VALIDATION_HOOKS`` as a comma-separated list...), then command-line flags. ``model``
and ``target_modules`` read the trainer's variables (``PLEXRL_MODEL``,
``PLEXRL_TARGET_MODULES``), so one environment tells both which layers carry LoRA.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.config import DEFAULT_MAX_LORA_RANK
from services.config.fields import Token


class RegistrySettings(BaseModel):
    """Everything ``plexrl registry`` can be told."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    output_dir: Path = Field(
        Path("outputs"), description="where run directories live: {output_dir}/run_*/"
    )
    max_runs: int = Field(
        4, ge=1, le=4096, description="size of the index pool (the trainer's adapter slots)"
    )
    scan_interval: float = Field(
        5.0, gt=0, le=3600, description="seconds between two scans of output_dir"
    )
    validation_hooks: list[str] = Field(
        default_factory=list,
        description="extra config checks as 'module:function', called with the OrchConfig and "
        "returning (ok, message)",
    )
    max_lora_rank: int = Field(
        DEFAULT_MAX_LORA_RANK, ge=1, le=1024, description="largest LoRA rank a run may ask for"
    )
    max_async_level: int = Field(
        64, ge=0, le=64, description="largest max_async_level a run may ask for"
    )
    model: Path | None = Field(
        None,
        description="the deployment's model directory (the trainer's --model); when set, the "
        "registry reads its config.json at start-up and refuses to start if a LoRA target is "
        "not a layer the trainer can wrap (no weights are read)",
    )
    target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description="the trainer's target_modules, checked against model; unset: the model "
        "family's default, as in the trainer",
    )
    tenants_file: Path | None = Field(
        None,
        description="the tenants file (TOML, `plexrl tenants add` writes it): which tenants may "
        "submit runs and their quotas; unset: only the default tenant, no quotas",
    )
    ingest_max_request_bytes: int = Field(
        256 * 1024,
        ge=4096,
        le=64 * 1024 * 1024,
        description="largest submit or evict request a tenant may send (with accounts, the "
        "registry checks tenants' writes before storing them)",
    )
    consumer_name: Token = Field(
        "registry",
        description="prefix of the durable consumers on plexrl.runs[.<tenant>].submit / .evict; "
        "one per registry deployment",
    )
    service: Token = Field(
        "registry", description="service name: errors go to plexrl.errors.<service>"
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split_target_modules(cls, v: object) -> object:
        # PLEXRL_TARGET_MODULES arrives as one string: "q_proj,v_proj" or "q_proj v_proj".
        return [t for t in re.split(r"[,\s]+", v) if t] if isinstance(v, str) else v

    @field_validator("validation_hooks")
    @classmethod
    def _hook_form(cls, v: list[str]) -> list[str]:
        for name in v:
            module, sep, attr = name.partition(":")
            if not sep or not module or not attr:
                raise ValueError(f"{name!r} is not of the form 'module:function'")
        return v
