"""The orchestrator process's settings (not the run's: those are the run's ``orch.toml``).

Loaded by :func:`services.config.load_settings`; precedence, lowest first: defaults,
``PLEXRL_<FIELD>`` environment variables (``PLEXRL_OUTPUT_DIR``, ``PLEXRL_MODEL``,
``PLEXRL_REQUEST_TIMEOUT``...), then command-line flags.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator


class OrchestratorSettings(BaseModel):
    """Everything ``plexrl orchestrator`` can be told besides the run id and its config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    output_dir: Path = Field(
        Path("outputs"),
        description="where run directories live; metrics.jsonl and the checkpoint go in "
        "{output_dir}/<run_id>/",
    )
    model: Path | None = Field(
        None,
        description="model directory whose tokenizer encodes prompts and decodes completions: "
        "the model inference serves",
    )
    request_timeout: float = Field(
        120.0,
        gt=0,
        le=7200,
        description="seconds one generate request may take (waiting for the policy version "
        "included) before it is retried",
    )
    progress_every_s: float = Field(
        2.0,
        ge=0,
        le=60,
        description="seconds between the progress messages a replica holding a generate request "
        "is asked to send; after 3 * this + 2 seconds without one the replica is presumed dead "
        "and the request is sent again at once (0: ask for none, wait request_timeout)",
    )
    wait_for_training: bool = Field(
        True,
        description="after the last step, wait until the trainer announces version max_steps",
    )
    max_concurrent_requests: int = Field(
        64, ge=1, le=4096, description="generate requests in flight at once"
    )
    registry_service: str = Field(
        "registry",
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="service name of the registry: its refusals arrive on plexrl.errors.<name>",
    )

    @field_validator("progress_every_s")
    @classmethod
    def _progress_off_or_in_range(cls, value: float) -> float:
        if 0 < value < 0.1:
            raise ValueError("must be 0 (off) or at least 0.1 seconds")
        return value
