"""Training commands: the trainer's request/reply path beside RolloutBatch (Tinker-style).

A run whose config says ``driver = "commands"`` (``schemas/config.py``) is trained by explicit commands instead of by
RolloutBatch events: ``forward_backward`` computes a loss over caller-supplied data and adds
the gradients to the run's adapter, ``optim_step`` applies the run's optimizer, and
``save_weights`` / ``load_weights`` write and restore the adapter, and ``checkpoints`` lists,
reads and deletes what was saved. The HTTP gateway turns the
Tinker API into these requests; any client may send them.

Core NATS request/reply, answered by the trainer, on ``plexrl.train.<kind>`` for the default
tenant and ``plexrl.train.<tenant>.<kind>`` for tenant ``<tenant>`` (the tenant convention of
:mod:`schemas.subjects`). The trainer reads the tenant from the subject, which the broker
vouches for, and refuses a run of another tenant. Each answer is the request's result type;
on failure its ``error`` says why and nothing was applied.

Every request carries a ``request_id``: the trainer keeps the results of a run's recent
requests, and a retried request id gets the stored result without being applied again.

The data of a ForwardBackwardRequest follows Tinker: ``model_input`` holds the ``T`` input
token ids, and every list in ``loss_fn_inputs`` holds ``T`` values, one per input position,
where position ``t`` scores ``target_tokens[t]`` as the token after ``model_input[:t+1]``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from schemas.events import Event, NonNegInt, RunId, Step, TokenId
from schemas.tenant import DEFAULT_TENANT, validate_tenant

RequestId = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=256,
        description="the caller's id of this request; a retry with the same id is not applied "
        "twice",
    ),
]

LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo")
"""The loss functions the trainer implements (Tinker's names)."""

LOSS_FN_INPUT_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
"""The ``loss_fn_inputs`` keys each loss needs (``weights`` defaults to all ones)."""


class Datum(msgspec.Struct, frozen=True, kw_only=True):
    """One sequence of a ForwardBackwardRequest.

    ``model_input``: the input token ids. ``loss_fn_inputs``: per-position values, each list as
    long as ``model_input``: ``target_tokens`` (integers, the token to score at each position),
    ``weights`` (cross_entropy; default 1), ``logprobs`` (the sampling policy's log-probability
    of each target token) and ``advantages`` (importance_sampling, ppo).
    """

    model_input: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    loss_fn_inputs: dict[str, list[float]] = msgspec.field(default_factory=dict)


class ForwardBackwardRequest(Event, frozen=True, kw_only=True, tag="forward_backward_request"):
    """Compute ``loss_fn`` over ``data`` under the run's adapter and accumulate its gradients.

    Producer: the gateway, any client. Consumer: trainer.
    Subject: ``plexrl.train[.<tenant>].forward_backward`` (request/reply); the reply is a
    ForwardBackwardResult. Gradients add up in the run's adapter until its next OptimStepRequest.
    ``forward_only`` computes the log-probabilities and the loss without touching gradients.
    ``loss_fn`` is one of :data:`LOSS_FNS`; ``loss_fn_config`` tunes it (ppo:
    ``clip_low_threshold``, ``clip_high_threshold``, default 0.8 and 1.2).
    """

    request_id: RequestId
    run_id: RunId
    data: Annotated[list[Datum], msgspec.Meta(min_length=1)]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None
    forward_only: bool = False


class ForwardBackwardResult(Event, frozen=True, kw_only=True, tag="forward_backward_result"):
    """The reply to a ForwardBackwardRequest.

    Producer: trainer. Consumer: the requester.
    ``loss_fn_outputs[i]`` belongs to ``data[i]``: ``logprobs`` (of each target token under the
    run's current adapter) and ``elementwise_loss`` (each position's weighted loss term).
    ``metrics`` holds ``loss:sum``, ``tokens:sum`` and ``runs_in_pass:max`` (how many runs'
    requests shared the trainer's pass), named ``<name>:<reduction>`` as the Tinker API does. ``step`` is the number of optimizer
    steps the adapter had taken. On failure ``loss_fn_outputs`` is empty, ``error`` says why, and
    no gradient was accumulated.
    """

    request_id: str
    run_id: str
    loss_fn_outputs: list[dict[str, list[float]]] = msgspec.field(default_factory=list)
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    step: NonNegInt = 0
    error: str | None = None


class AdamParams(msgspec.Struct, frozen=True, kw_only=True):
    """One AdamW step's hyperparameters (Tinker's names and defaults). ``grad_clip_norm`` 0
    means no clipping."""

    learning_rate: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 1e-4
    beta1: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.9
    beta2: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.95
    eps: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1e-12
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 0.0
    grad_clip_norm: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0


class OptimStepRequest(Event, frozen=True, kw_only=True, tag="optim_step_request"):
    """Apply the gradients accumulated since the run's last step with ``adam_params``.

    Producer: the gateway, any client. Consumer: trainer.
    Subject: ``plexrl.train[.<tenant>].optim_step`` (request/reply); the reply is an
    OptimStepResult. The run's step (its policy version) goes up by one and its progress is
    written to ``plexrl-progress``.
    """

    request_id: RequestId
    run_id: RunId
    adam_params: AdamParams = msgspec.field(default_factory=AdamParams)


class OptimStepResult(Event, frozen=True, kw_only=True, tag="optim_step_result"):
    """The reply to an OptimStepRequest.

    Producer: trainer. Consumer: the requester.
    ``step`` is the run's step after the update. ``metrics`` holds ``grad_norm`` (before
    clipping), ``learning_rate`` and the number of forward_backward requests the step applied.
    On failure ``error`` says why and the adapter is unchanged.
    """

    request_id: str
    run_id: str
    step: NonNegInt = 0
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    error: str | None = None


SaveKind = Literal["sampler", "state"]

CheckpointName = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[A-Za-z0-9_.-]{0,128}(?!\n)$",
        description="a checkpoint name: up to 128 letters, digits, '_', '-' or '.' (empty: "
        "step_<n>)",
    ),
]


class SaveWeightsRequest(Event, frozen=True, kw_only=True, tag="save_weights_request"):
    """Save the run's adapter.

    Producer: the gateway, any client. Consumer: trainer.
    Subject: ``plexrl.train[.<tenant>].save_weights`` (request/reply); the reply is a
    SaveWeightsResult. ``kind = "sampler"`` publishes the adapter as WeightsReady (so inference
    serves it, exactly as after a RolloutBatch step); ``kind = "state"`` writes a checkpoint
    (adapter, optimizer and progress) under ``{output_dir}/<run_id>/checkpoints/<name>/`` that
    a LoadWeightsRequest restores. An empty name writes the run's regular ``step_<n>``
    checkpoint (the one a restarted trainer resumes from); names starting ``step_`` or ``.``
    are reserved.
    """

    request_id: RequestId
    run_id: RunId
    kind: SaveKind = "sampler"
    name: CheckpointName = ""
    overwrite: bool = True
    """with ``kind = "state"`` and a name: replace a checkpoint of that name (False: refuse,
    and keep the one there)"""


class SaveWeightsResult(Event, frozen=True, kw_only=True, tag="save_weights_result"):
    """The reply to a SaveWeightsRequest.

    Producer: trainer. Consumer: the requester.
    ``path`` is ``<run_id>@<step>`` (sampler: the policy version inference now serves, as a
    generate request's ``min_policy_version`` or the gateway's model name asks for it) or the
    checkpoint name (state) that LoadWeightsRequest takes; ``step`` the adapter's step. On
    failure ``error`` says why.
    """

    request_id: str
    run_id: str
    kind: SaveKind = "sampler"
    step: NonNegInt = 0
    path: str = ""
    error: str | None = None


class LoadWeightsRequest(Event, frozen=True, kw_only=True, tag="load_weights_request"):
    """Restore the run's adapter (and, with ``optimizer``, its optimizer state and step) from a
    checkpoint a ``state`` save wrote for the same run.

    Producer: the gateway, any client. Consumer: trainer.
    Subject: ``plexrl.train[.<tenant>].load_weights`` (request/reply); the reply is a
    LoadWeightsResult. Gradients accumulated before the load are dropped. With
    ``source_run_id`` the checkpoint is another run's of the same tenant (active, evicted or
    finished): a fork, which must have the same LoRA rank.
    """

    request_id: RequestId
    run_id: RunId
    path: Annotated[
        str,
        msgspec.Meta(
            pattern=r"^[A-Za-z0-9_.-]{1,128}(?!\n)$",
            description="the name a state save answered with",
        ),
    ]
    optimizer: bool = True
    source_run_id: RunId | None = None
    """the run whose checkpoint to load (None: this run's own)"""


class LoadWeightsResult(Event, frozen=True, kw_only=True, tag="load_weights_result"):
    """The reply to a LoadWeightsRequest: the run's ``step`` after the load, or ``error``."""

    request_id: str
    run_id: str
    step: Step = 0
    error: str | None = None


CheckpointOp = Literal["list", "read", "delete", "expire"]

CHUNK_MAX = 1 << 19
"""the most bytes one ``read`` answers with (they travel inline, base64 in JSON)"""


class CheckpointFile(msgspec.Struct, frozen=True, kw_only=True):
    """A file of a checkpoint's PEFT adapter: its path under the checkpoint and its size."""

    path: str
    size_bytes: NonNegInt


class CheckpointInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One saved state (``kind = "state"``) or sampler save (``kind = "sampler"``) of a run.

    ``name`` is what a LoadWeightsRequest takes (state) or the save's name (sampler);
    ``step`` the adapter's step; ``created_at`` and ``expires_at`` (0: never) epoch seconds;
    ``files`` the adapter's files (state only), which ``read`` serves.
    """

    name: str
    kind: SaveKind
    step: NonNegInt
    created_at: float = 0.0
    size_bytes: NonNegInt = 0
    rank: NonNegInt = 0
    alpha: float = 0.0
    expires_at: float = 0.0
    files: list[CheckpointFile] = msgspec.field(default_factory=list)


class CheckpointsRequest(Event, frozen=True, kw_only=True, tag="checkpoints_request"):
    """List, read, delete or set the expiry of a run's saved checkpoints.

    Producer: the gateway, any client. Consumer: trainer (answered at once, between steps
    or not). Subject: ``plexrl.train[.<tenant>].checkpoints`` (request/reply); the reply is a
    CheckpointsResult. The run may be active, evicted or finished, but must be the subject's
    tenant's. ``op``:

    - ``list``: every checkpoint (``name`` empty) or the one named ``name``;
    - ``read``: up to ``length`` bytes (at most :data:`CHUNK_MAX`) of the adapter file ``file``
      of state checkpoint ``name``, from ``offset``;
    - ``delete``: remove checkpoint ``name`` (``kind`` says which);
    - ``expire``: the checkpoint ``name`` is deleted ``ttl_s`` seconds from now (0: never).
    """

    request_id: RequestId
    run_id: RunId
    op: CheckpointOp = "list"
    kind: SaveKind = "state"
    name: CheckpointName = ""
    file: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{0,128}(?!\n)$")] = ""
    offset: NonNegInt = 0
    length: Annotated[int, msgspec.Meta(ge=0, le=CHUNK_MAX)] = 0
    ttl_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e10)] = 0.0


class CheckpointsResult(Event, frozen=True, kw_only=True, tag="checkpoints_result"):
    """The reply to a CheckpointsRequest: the checkpoints listed (newest last), the bytes
    read, or ``error`` (nothing changed)."""

    request_id: str
    run_id: str
    checkpoints: list[CheckpointInfo] = msgspec.field(default_factory=list)
    data: bytes = b""
    error: str | None = None


TrainRequest = (
    ForwardBackwardRequest
    | OptimStepRequest
    | SaveWeightsRequest
    | LoadWeightsRequest
    | CheckpointsRequest
)
TrainResult = (
    ForwardBackwardResult
    | OptimStepResult
    | SaveWeightsResult
    | LoadWeightsResult
    | CheckpointsResult
)

TRAINING_EVENTS: tuple[type[Event], ...] = (
    ForwardBackwardRequest,
    ForwardBackwardResult,
    OptimStepRequest,
    OptimStepResult,
    SaveWeightsRequest,
    SaveWeightsResult,
    LoadWeightsRequest,
    LoadWeightsResult,
    CheckpointsRequest,
    CheckpointsResult,
)

# --- subjects ------------------------------------------------------------------------------

TRAIN_FAMILY = "plexrl.train"
TRAIN_WILDCARD = "plexrl.train.>"
"""Every command of every tenant: the trainer's one subscription (one ordering for all)."""

TRAIN_COMMANDS: dict[str, tuple[type[Event], type[Event], str]] = {
    "forward_backward": (
        ForwardBackwardRequest,
        ForwardBackwardResult,
        "compute a loss over caller-supplied data and accumulate the run's gradients",
    ),
    "optim_step": (
        OptimStepRequest,
        OptimStepResult,
        "step the run's optimizer over the gradients accumulated since its last step",
    ),
    "save_weights": (
        SaveWeightsRequest,
        SaveWeightsResult,
        "publish the run's adapter for inference or write a resumable checkpoint",
    ),
    "load_weights": (
        LoadWeightsRequest,
        LoadWeightsResult,
        "restore the run's adapter and optimizer from a checkpoint",
    ),
    "checkpoints": (
        CheckpointsRequest,
        CheckpointsResult,
        "list, read, delete or expire a run's saved checkpoints",
    ),
}
"""kind -> (request, result, summary) of each training command."""


def train_subject(kind: str, tenant: str = DEFAULT_TENANT) -> str:
    """``plexrl.train[.<tenant>].<kind>`` for a kind of :data:`TRAIN_COMMANDS`."""
    if kind not in TRAIN_COMMANDS:
        raise ValueError(f"unknown training command {kind!r}; one of {', '.join(TRAIN_COMMANDS)}")
    if tenant == DEFAULT_TENANT:
        return f"{TRAIN_FAMILY}.{kind}"
    return f"{TRAIN_FAMILY}.{validate_tenant(tenant)}.{kind}"


def parse_train_subject(subject: str) -> tuple[str, str]:
    """(tenant, kind) of a training command subject, either form; ``ValueError`` otherwise."""
    tokens = subject.split(".")
    if tokens[:2] == ["plexrl", "train"] and tokens[-1] in TRAIN_COMMANDS:
        if len(tokens) == 3:
            return DEFAULT_TENANT, tokens[2]
        if len(tokens) == 4:
            return validate_tenant(tokens[2]), tokens[3]
    raise ValueError(
        f"{subject!r} is not a training command subject "
        f"(plexrl.train[.<tenant>].<{'|'.join(TRAIN_COMMANDS)}>)"
    )
