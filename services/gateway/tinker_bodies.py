"""The JSON bodies of the Tinker routes, typed.

Each route reads its body through one of these models (:func:`services.gateway.app.parse_body`),
so a field of the wrong type or out of range is a 400 naming the field, before any work starts
or any message reaches the bus. Fields the SDK sends and plexrl does not use are accepted and
ignored (``extra="allow"``), as are ``null``s for optional fields; numbers are finite.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from schemas.events import MAX_TOP_LOGPROBS

INT64_MAX = 2**63 - 1
SEED_MAX = 2**64 - 1


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class Chunk(Body):
    type: str = "encoded_text"
    tokens: list[int] = Field(default_factory=list)


class ModelInput(Body):
    chunks: list[Chunk] = Field(default_factory=list)


class SamplingParams(Body):
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=1_000_000)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: str | int | list[str | int] | None = None


class SampleBody(Body):
    sampling_session_id: str | None = None
    seq_id: int | None = Field(None, ge=0, le=INT64_MAX)
    model_path: str | None = None
    base_model: str | None = None
    prompt: ModelInput = Field(default_factory=ModelInput)
    num_samples: int = 1
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    topk_sample_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs_last_n: int | None = Field(None, ge=1, le=INT64_MAX)
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)


class SamplingSessionBody(Body):
    session_id: str | None = Field(None, max_length=256)
    model_path: str | None = None
    base_model: str | None = None


class LoraConfig(Body):
    rank: int = Field(32, ge=1)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class OptimizerConfig(Body):
    type: str = "adamw"


class CreateModelBody(Body):
    session_id: str = ""
    model_seq_id: int = Field(0, ge=0, le=INT64_MAX)
    base_model: str | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig | None = None
    user_metadata: dict[str, Any] | None = None


class ModelBody(Body):
    """A request about one training client: its model and the request's place in its order."""

    model_id: str | None = None
    seq_id: int | None = Field(None, ge=0, le=INT64_MAX)


class OptimStepBody(ModelBody):
    adam_params: dict[str, Any] | None = None
    """Checked against :class:`schemas.training.AdamParams` by the route."""


class SaveWeightsBody(ModelBody):
    path: str | None = None
    sampling_session_seq_id: int | None = None
    overwrite: bool = False
    ttl_seconds: int | None = Field(None, ge=1, le=10 * 366 * 86400)


class LoadWeightsBody(ModelBody):
    path: str | None = None
    optimizer: bool = True
    session_id: str | None = Field(None, max_length=256)
    model_seq_id: int | None = Field(None, ge=0, le=INT64_MAX)
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: OptimizerConfig | None = None


class FutureBody(Body):
    request_id: str = ""


class PathBody(Body):
    tinker_path: str = Field("", max_length=1024)


class CreateSessionBody(Body):
    user_metadata: dict[str, Any] | None = None
    display_name: str | None = Field(None, max_length=1024)


class SessionBody(Body):
    session_id: str = Field("", max_length=256)


class FinishReason(Body):
    type: str = Field("success", max_length=64)


class FinishBody(Body):
    reason: FinishReason | None = None
    detail: str | None = None


class Page(Body):
    """A listing's query string."""

    limit: int = Field(20, ge=1, le=1000)
    offset: int = Field(0, ge=0, le=INT64_MAX)
