"""Every event plexrl puts on the bus.

Each event is a frozen, keyword-only ``msgspec.Struct`` tagged by its ``type`` field with an
explicit tag string, so renaming a class never changes the wire. Every event carries
``schema_version``. Wire events tolerate unknown fields, so an old consumer keeps working when a
producer adds one; new fields are added at the end, with defaults.

The canonical encoding is JSON; MessagePack is accepted when the message says so with the
header ``Content-Type: application/msgpack``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from schemas.run_id import RUN_ID_PATTERN
from schemas.tenant import DEFAULT_TENANT

SCHEMA_VERSION = 1
"""The version this code writes. Readers accept every version listed in SUPPORTED_VERSIONS."""

SUPPORTED_VERSIONS = (1,)

# msgspec (like Python's jsonschema) applies a pattern with re.search, where "$" also matches just
# before a final newline: "run_a\n" would pass. The lookahead (here and in Digest) rules that out;
# in ECMA-262, the dialect of JSON Schema, "$" is already the end of the input and the lookahead
# changes nothing.
_RUN_ID_WIRE_PATTERN = RUN_ID_PATTERN.removesuffix("$") + r"(?!\n)$"

RunId = Annotated[
    str,
    msgspec.Meta(
        pattern=_RUN_ID_WIRE_PATTERN,
        description="'run_' followed by 1-64 letters, digits, '_' or '-'",
        examples=["run_abc123"],
    ),
]
RunIndex = Annotated[
    int, msgspec.Meta(ge=0, le=4095, description="the run's slot in the index pool")
]
Tenant = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^(?!run_)[A-Za-z0-9_-]{1,64}(?!\n)$",
        description="the tenant that owns the run: 1-64 letters, digits, '_' or '-', "
        "not starting with 'run_' ('default' when no tenants are configured)",
        examples=["default", "team-a"],
    ),
]
Step = Annotated[int, msgspec.Meta(ge=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
Digest = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^(blake3|sha256):[0-9a-f]{64}(?!\n)$",
        description=(
            "<algorithm>:<64 lowercase hex digits> of the whole safetensors stream: blake3 from "
            "current publishers, sha256 from older ones; readers accept both"
        ),
    ),
]
ShortText = Annotated[str, msgspec.Meta(max_length=16384)]
Transport = Literal["object_store", "filesystem", "ucx", "collective"]
WeightKind = Literal["lora", "full"]
FinishReason = Literal["stop", "length"]


class Event(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=False
):
    """Base of every event: the ``type`` tag and the schema version it was written with."""

    schema_version: Annotated[int, msgspec.Meta(ge=1)] = SCHEMA_VERSION


# --- run lifecycle (stream PLEXRL_RUNS) ------------------------------------------------------


class RunSubmitted(Event, frozen=True, kw_only=True, tag="run_submitted"):
    """A client asks for a run.

    Producer: any client (``plexrl submit``, ``plexrl orchestrator``, Node.js, curl...).
    Consumer: registry, which validates ``config`` (the ``orch.toml`` content as an object),
    writes ``{output_dir}/<run_id>/control/orch.toml`` and discovers the run.
    Subject: ``plexrl.runs.submit``.
    """

    run_id: RunId
    config: dict[str, Any]
    submitted_by: str = ""


class RunDiscovered(Event, frozen=True, kw_only=True, tag="run_discovered"):
    """A run passed validation and holds index ``idx``.

    Producer: registry. Consumers: the run mirror in trainer and inference; orchestrators.
    Subject: ``plexrl.runs.discovered``.
    """

    run_id: RunId
    idx: RunIndex
    config: dict[str, Any]
    config_digest: str = ""
    tenant: Tenant = DEFAULT_TENANT


class RunConfigInvalid(Event, frozen=True, kw_only=True, tag="run_config_invalid"):
    """A run's config was rejected; it holds no index until its config changes.

    Producer: registry. Consumers: orchestrators, operators.
    Subject: ``plexrl.runs.invalid``.
    """

    run_id: RunId
    error: ShortText
    tenant: Tenant = DEFAULT_TENANT


class EvictRequested(Event, frozen=True, kw_only=True, tag="evict_requested"):
    """Someone asks the registry to evict a run.

    Producers: trainer (bad data, divergence), ``plexrl evict``, any client.
    Consumer: registry. Subject: ``plexrl.runs.evict``.
    """

    run_id: RunId
    reason: ShortText
    requested_by: str = ""
    delete: bool = False
    """also delete the run's directory (its checkpoints too) once it is evicted, so the run is
    forgotten and its id free again; only for a run already evicted or invalid (evict an
    active run first)"""


class RunEvicted(Event, frozen=True, kw_only=True, tag="run_evicted"):
    """A run was evicted: ``control/evicted.txt`` holds the reason and its index is free.

    Producer: registry. Consumers: run mirrors (deletion hooks), the run's orchestrator (exits).
    Subject: ``plexrl.runs.evicted``.
    """

    run_id: RunId
    idx: RunIndex
    reason: ShortText
    tenant: Tenant = DEFAULT_TENANT


class RunForgotten(Event, frozen=True, kw_only=True, tag="run_forgotten"):
    """A run's directory disappeared; its index is free.

    Producer: registry. Consumers: run mirrors (deletion hooks), orchestrators.
    Subject: ``plexrl.runs.forgotten``.
    """

    run_id: RunId
    idx: RunIndex
    tenant: Tenant = DEFAULT_TENANT


# --- rollouts (stream PLEXRL_ROLLOUTS) --------------------------------------------------------


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One scored completion. ``completion_logprobs[i]`` is the sampling policy's log-probability
    of ``completion_ids[i]``; the two lists have the same length."""

    prompt_ids: list[TokenId]
    completion_ids: list[TokenId]
    completion_logprobs: list[float]
    reward: float
    advantage: float


class RolloutBatch(Event, frozen=True, kw_only=True, tag="rollout_batch"):
    """The samples of one step of one run.

    Producer: the run's orchestrator. Consumer: trainer.
    Subject: ``plexrl.rollouts.<run_id>``; message id ``<run_id>/step_<step>`` so a republished
    step is deduplicated. ``policy_version`` is the oldest version that generated any sample.
    """

    run_id: RunId
    step: Step
    policy_version: NonNegInt
    samples: list[Sample]


# --- weights (stream PLEXRL_WEIGHTS) ----------------------------------------------------------


class LoraSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of an adapter: its rank, alpha and the module names it targets.

    ``fan_in_fan_out`` is True when the targets store their weight [in, out] (GPT-2's Conv1D),
    as PEFT's ``adapter_config.json`` says it; absent (every message before the field existed)
    means False, nn.Linear targets.
    """

    rank: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    alpha: Annotated[float, msgspec.Meta(gt=0)]
    target_modules: list[str]
    fan_in_fan_out: bool = False


class WeightsReady(Event, frozen=True, kw_only=True, tag="weights_ready"):
    """A run's adapter after ``step`` optimizer steps (policy version ``step``) is ready.

    Producer: trainer. Consumer: inference (loads it), orchestrators (version bookkeeping).
    Subject: ``plexrl.weights.<run_id>``. ``location`` is read according to ``transport``: an
    object-store key ``<run_id>/step_<n>``, a PEFT directory, a UCX address or a collective
    group name. ``digest`` is ``blake3:<hex>`` of the stored safetensors bytes (``sha256:<hex>``
    from publishers before BLAKE3; readers accept both and check the one named).

    ``kind`` says what the tensors are: absent or ``lora`` (every message before the field
    existed), the run's adapter with PEFT key names, shaped as ``lora`` says; or ``full``, the
    whole model's state dict (Hugging Face key names) of a trainer that trains without LoRA (one
    run, ``max_runs = 1``), where ``lora`` is the run's configured adapter and unused. An adapter
    announcement leaves it out, so it stays byte for byte what it was.
    """

    run_id: RunId
    idx: RunIndex
    step: Step
    transport: Transport
    location: str
    digest: Digest
    size_bytes: NonNegInt
    lora: LoraSpec
    kind: WeightKind | msgspec.UnsetType = msgspec.UNSET

    @property
    def is_full(self) -> bool:
        """The tensors are a whole model's state dict, not an adapter."""
        return self.kind == "full"


# --- errors (stream PLEXRL_ERRORS) ------------------------------------------------------------


class InvalidMessage(Event, frozen=True, kw_only=True, tag="invalid_message"):
    """A message a service could not decode or validate. It was terminated, not redelivered.

    Producer: any service, on ``plexrl.errors.<service>``. Consumers: operators, dashboards.
    ``leading_bytes`` holds the first bytes of the payload (base64 in JSON).
    """

    service: str
    subject: str
    error: ShortText
    leading_bytes: bytes = b""


class ServiceError(Event, frozen=True, kw_only=True, tag="service_error"):
    """A failure a service reports without crashing: a weight blob that fails its digest, a
    run that cannot be served.

    Producer: any service, on ``plexrl.errors.<service>``. Consumers: operators, dashboards.
    """

    service: str
    error: ShortText
    run_id: str | None = None
    context: dict[str, str] = msgspec.field(default_factory=dict)


# --- the run list (request/reply, answered by the registry) -----------------------------------

RunStatusName = Literal["waiting", "active", "invalid", "evicted", "forgotten"]
"""A run's status in the registry (the same names as :data:`schemas.records.RunStatus`)."""


class RunListRequest(Event, frozen=True, kw_only=True, tag="run_list_request"):
    """Asks the registry for its run table with each run's progress.

    Producer: ``plexrl runs``, dashboards, any client. Consumer: registry.
    Subject: ``plexrl.registry.list`` (every run; the default tenant's credentials) or
    ``plexrl.registry.<tenant>.list`` (only that tenant's runs), request/reply; the reply is a
    RunList. The tenant is read from the subject, which the broker vouches for: ``tenant`` in the
    body is informative only and never widens the answer. An empty body asks with the defaults.
    """

    tenant: str | None = None
    statuses: list[RunStatusName] = msgspec.field(default_factory=list)
    """only runs in these statuses (empty: every status)"""


class RunRow(msgspec.Struct, frozen=True, kw_only=True):
    """One run in a RunList: its table record joined with its progress in ``plexrl-progress``."""

    run_id: RunId
    tenant: Tenant = DEFAULT_TENANT
    status: RunStatusName
    idx: RunIndex | None = None
    step: NonNegInt | None = None
    total_tokens: NonNegInt | None = None
    total_samples: NonNegInt | None = None
    reward_mean: float | None = None
    updated_at: float = 0.0
    """the later of the run's last table write and its last progress write (epoch seconds)"""
    detail: str = ""
    """why the run is invalid or evicted"""
    config_digest: str = ""
    """the digest of the config the registry holds for the run (``sha256:...``, as in
    RunDiscovered); empty when it holds none (an invalid run) or from a registry before this
    field: a client compares it with its own config's to tell its run from another's"""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    """the ``labels`` of the run's config (empty without any, or from a registry before this
    field)"""


class RunList(Event, frozen=True, kw_only=True, tag="run_list"):
    """The registry's answer to a RunListRequest.

    Producer: registry. Consumer: the requester.
    ``runs`` holds the runs the subject's tenant may see (every run for the default tenant),
    active first. On failure (a request that does not decode, an answer too big for one message)
    ``runs`` is empty and ``error`` says why.
    """

    tenant: Tenant = DEFAULT_TENANT
    runs: list[RunRow] = msgspec.field(default_factory=list)
    error: str | None = None


# Generation and the training commands live in their own modules, which build on the
# definitions above.
from schemas.generation import (  # noqa: E402, F401  (re-exported: their home was here)
    MAX_TOP_LOGPROBS,
    Completion,
    GenerateCancel,
    GenerateProgress,
    GenerateRequest,
    GenerateResponse,
    ProgressState,
    PromptLogprobs,
    TopLogprobs,
)
from schemas.training import TRAINING_EVENTS, TrainRequest, TrainResult  # noqa: E402

ALL_EVENTS: tuple[type[Event], ...] = (
    RunSubmitted,
    RunDiscovered,
    RunConfigInvalid,
    EvictRequested,
    RunEvicted,
    RunForgotten,
    RolloutBatch,
    WeightsReady,
    GenerateRequest,
    GenerateResponse,
    GenerateProgress,
    GenerateCancel,
    InvalidMessage,
    ServiceError,
    RunListRequest,
    RunList,
    *TRAINING_EVENTS,
)

AnyEvent = (
    RunSubmitted
    | RunDiscovered
    | RunConfigInvalid
    | EvictRequested
    | RunEvicted
    | RunForgotten
    | RolloutBatch
    | WeightsReady
    | GenerateRequest
    | GenerateResponse
    | GenerateProgress
    | GenerateCancel
    | InvalidMessage
    | ServiceError
    | RunListRequest
    | RunList
    | TrainRequest
    | TrainResult
)

RunEvent = (
    RunSubmitted | RunDiscovered | RunConfigInvalid | EvictRequested | RunEvicted | RunForgotten
)


def event_tag(cls: type[Event]) -> str:
    """The wire ``type`` string of an event class."""
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag
