"""Where each event travels: subjects, streams, buckets and the object store, stated once.

The bus layer creates streams and subscriptions from these names, publishers compute subjects
with the functions below, and ``schemas/asyncapi.yaml`` is generated from :data:`CHANNELS`, so
the table in DESIGN.md ("Subjects, streams and buckets") has exactly one copy in code.

Every variable subject token is checked before it reaches a subject: a run id with
:func:`schemas.run_id.validate_run_id`, a service name with the same character set, so no dot,
wildcard or whitespace can widen a subscription or split a token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from schemas.collective import GroupFormed, GroupState, JoinRequest, LeaveRequest, Ping, Pong
from schemas.events import (
    Event,
    EvictRequested,
    GenerateCancel,
    GenerateProgress,
    GenerateRequest,
    GenerateResponse,
    InvalidMessage,
    RolloutBatch,
    RunConfigInvalid,
    RunDiscovered,
    RunEvicted,
    RunForgotten,
    RunList,
    RunListRequest,
    RunSubmitted,
    ServiceError,
    WeightsReady,
)
from schemas.ingest import INGEST_FAMILY, INGEST_QUEUE_GROUP
from schemas.run_id import validate_run_id
from schemas.tenant import DEFAULT_TENANT, validate_tenant
from schemas.training import TRAIN_COMMANDS, train_subject

# --- streams ---------------------------------------------------------------------------------

RUNS_STREAM = "PLEXRL_RUNS"
ROLLOUTS_STREAM = "PLEXRL_ROLLOUTS"
WEIGHTS_STREAM = "PLEXRL_WEIGHTS"
ERRORS_STREAM = "PLEXRL_ERRORS"

RUNS_WILDCARD = "plexrl.runs.>"
ROLLOUTS_WILDCARD = "plexrl.rollouts.>"
WEIGHTS_WILDCARD = "plexrl.weights.>"
ERRORS_WILDCARD = "plexrl.errors.>"


@dataclass(frozen=True)
class Stream:
    """A JetStream stream: its name, the subjects it captures and what it holds."""

    name: str
    subjects: tuple[str, ...]
    description: str


STREAMS: tuple[Stream, ...] = (
    Stream(RUNS_STREAM, (RUNS_WILDCARD,), "run lifecycle events"),
    Stream(ROLLOUTS_STREAM, (ROLLOUTS_WILDCARD,), "rollout batches, one message per run step"),
    Stream(WEIGHTS_STREAM, (WEIGHTS_WILDCARD,), "WeightsReady announcements"),
    Stream(ERRORS_STREAM, (ERRORS_WILDCARD,), "invalid messages and service errors"),
)

# --- fixed subjects --------------------------------------------------------------------------

SUBMIT = "plexrl.runs.submit"
DISCOVERED = "plexrl.runs.discovered"
INVALID = "plexrl.runs.invalid"
EVICT = "plexrl.runs.evict"
EVICTED = "plexrl.runs.evicted"
FORGOTTEN = "plexrl.runs.forgotten"
GENERATE = "plexrl.inference.generate"
CANCEL = "plexrl.inference.cancel"
INFERENCE_QUEUE_GROUP = "inference"

_ROLLOUTS_PREFIX = "plexrl.rollouts."
_WEIGHTS_PREFIX = "plexrl.weights."
_ERRORS_PREFIX = "plexrl.errors."
_COLLECTIVE_PREFIX = "plexrl.collective."
DEFAULT_COLLECTIVE_GROUP = "default"

# --- key-value buckets and object store ------------------------------------------------------

KV_REGISTRY = "plexrl-registry"
KV_PROGRESS = "plexrl-progress"
OBJECT_STORE_WEIGHTS = "plexrl-weights"

KV_BUCKETS: dict[str, str] = {
    KV_REGISTRY: "run table: run_id -> {idx, status, config digest}",
    KV_PROGRESS: "per run: step, total_tokens, total_samples",
}
OBJECT_STORES: dict[str, str] = {
    OBJECT_STORE_WEIGHTS: "adapter weights (safetensors, PEFT key names), key <run_id>/step_<n>",
}

# --- variable subjects -----------------------------------------------------------------------

SERVICE_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_SERVICE_NAME_RE = re.compile(SERVICE_NAME_PATTERN)


def validate_service_name(service: object) -> str:
    """Return ``service`` if it can be one subject token, else raise ``ValueError``."""
    if not isinstance(service, str) or _SERVICE_NAME_RE.fullmatch(service) is None:
        raise ValueError(
            f"illegal service name {service!r}: a service name is 1-64 letters, digits, '_' or '-'"
        )
    return service


def rollouts_subject(run_id: str) -> str:
    """``plexrl.rollouts.<run_id>``: where a run's RolloutBatch events go."""
    return _ROLLOUTS_PREFIX + validate_run_id(run_id)


def weights_subject(run_id: str) -> str:
    """``plexrl.weights.<run_id>``: where a run's WeightsReady events go."""
    return _WEIGHTS_PREFIX + validate_run_id(run_id)


def errors_subject(service: str) -> str:
    """``plexrl.errors.<service>``: where a service reports InvalidMessage and ServiceError."""
    return _ERRORS_PREFIX + validate_service_name(service)


@dataclass(frozen=True)
class CollectiveSubjects:
    """The subjects of one collective weight-transport group (:mod:`schemas.collective`)."""

    join: str
    leave: str
    formed: str
    alive_prefix: str

    def alive(self, member: str) -> str:
        """Where ``member`` answers the sender's Ping."""
        return self.alive_prefix + validate_service_name(member)


def collective_subjects(group: str = DEFAULT_COLLECTIVE_GROUP) -> CollectiveSubjects:
    """``plexrl.collective.<group>.{join,leave,formed,alive.<member>}``."""
    base = _COLLECTIVE_PREFIX + validate_service_name(group)
    return CollectiveSubjects(f"{base}.join", f"{base}.leave", f"{base}.formed", f"{base}.alive.")


def run_id_from_subject(subject: str) -> str:
    """The run id that ends a rollouts or weights subject; ``ValueError`` for any other."""
    return per_run_subject(subject)[1]


def per_run_subject(subject: str) -> tuple[str, str]:
    """(tenant, run_id) of a rollouts or weights subject, either form; ``ValueError`` otherwise."""
    for prefix in (_ROLLOUTS_PREFIX, _WEIGHTS_PREFIX):
        if subject.startswith(prefix):
            rest = subject.removeprefix(prefix).split(".")
            if len(rest) == 1:
                return DEFAULT_TENANT, validate_run_id(rest[0])
            if len(rest) == 2:
                return _tenant_token(rest[0]), validate_run_id(rest[1])
            break
    raise ValueError(
        f"{subject!r} is not a per-run subject ({ROLLOUTS_WILDCARD}, {WEIGHTS_WILDCARD})"
    )


# --- tenants ---------------------------------------------------------------------------------
#
# The default tenant's runs use the subjects above. Tenant ``t``'s carry ``t`` as one more token
# after the family: ``plexrl.runs.t.submit``, ``plexrl.rollouts.t.<run_id>``,
# ``plexrl.inference.t.generate``... The broker's per-user permissions (``plexrl nats-config``)
# allow a tenant's credentials exactly its own token, so the tenant a service reads from a
# subject is the one the broker authenticated. The stream wildcards (``plexrl.runs.>``...)
# capture both forms, told apart by their number of tokens (a run id never holds a dot).

LIFECYCLE_KINDS = ("discovered", "invalid", "evicted", "forgotten")
REQUEST_KINDS = ("submit", "evict")
REGISTRY_LIST = "plexrl.registry.list"
"""request/reply: the run table with progress (a tenant's form lists only its own runs)"""

SUBMIT_TENANTS = "plexrl.runs.*.submit"
EVICT_TENANTS = "plexrl.runs.*.evict"
GENERATE_TENANTS = "plexrl.inference.*.generate"
CANCEL_TENANTS = "plexrl.inference.*.cancel"
REGISTRY_LIST_TENANTS = "plexrl.registry.*.list"


def _tenant_token(tenant: str) -> str:
    return validate_tenant(tenant)


def _with_tenant(family: str, rest: str, tenant: str) -> str:
    if tenant == DEFAULT_TENANT:
        return f"{family}.{rest}"
    return f"{family}.{_tenant_token(tenant)}.{rest}"


def runs_subject(kind: str, tenant: str = DEFAULT_TENANT) -> str:
    """``plexrl.runs[.<tenant>].<kind>`` for a request kind or a lifecycle event kind."""
    if kind not in REQUEST_KINDS + LIFECYCLE_KINDS:
        raise ValueError(f"unknown runs subject kind {kind!r}")
    return _with_tenant("plexrl.runs", kind, tenant)


def tenant_rollouts_subject(run_id: str, tenant: str = DEFAULT_TENANT) -> str:
    """``plexrl.rollouts[.<tenant>].<run_id>``."""
    return _with_tenant("plexrl.rollouts", validate_run_id(run_id), tenant)


def tenant_weights_subject(run_id: str, tenant: str = DEFAULT_TENANT) -> str:
    """``plexrl.weights[.<tenant>].<run_id>``."""
    return _with_tenant("plexrl.weights", validate_run_id(run_id), tenant)


def generate_subject(tenant: str = DEFAULT_TENANT, kind: str = "generate") -> str:
    """``plexrl.inference[.<tenant>].generate``; with ``kind="cancel"`` where GenerateCancel goes."""
    if kind not in ("generate", "cancel"):
        raise ValueError(f"unknown inference subject kind {kind!r}")
    return _with_tenant("plexrl.inference", kind, tenant)


def registry_list_subject(tenant: str = DEFAULT_TENANT) -> str:
    """``plexrl.registry[.<tenant>].list``."""
    return _with_tenant("plexrl.registry", "list", tenant)


def tenant_of_subject(subject: str) -> str:
    """The tenant a runs, rollouts, weights, generate or registry-list subject belongs to.

    ``ValueError`` for a subject of none of these families or with an illegal tenant token.
    """
    tokens = subject.split(".")
    if len(tokens) < 3 or tokens[0] != "plexrl":
        raise ValueError(f"{subject!r} is not a plexrl subject")
    family = tokens[1]
    if family in ("rollouts", "weights"):
        return per_run_subject(subject)[0]
    if family in ("runs", "inference", "registry") and len(tokens) in (3, 4):
        return DEFAULT_TENANT if len(tokens) == 3 else _tenant_token(tokens[2])
    raise ValueError(f"{subject!r} carries no tenant")


def weights_bucket(tenant: str = DEFAULT_TENANT) -> str:
    """The object store that holds a tenant's adapters: ``plexrl-weights[-<tenant>]``.

    One store per tenant, so the broker can let a tenant read its own adapters (the whole
    ``OBJ_plexrl-weights-<tenant>`` stream) and nobody else's.
    """
    if tenant == DEFAULT_TENANT:
        return OBJECT_STORE_WEIGHTS
    return f"{OBJECT_STORE_WEIGHTS}-{_tenant_token(tenant)}"


def rollout_msg_id(run_id: str, step: int) -> str:
    """The ``Nats-Msg-Id`` of a RolloutBatch, so that a republished step is deduplicated."""
    return f"{validate_run_id(run_id)}/step_{_step(step)}"


def weights_object_key(run_id: str, step: int) -> str:
    """The key of a run's adapter after ``step`` optimizer steps in ``plexrl-weights``."""
    return f"{validate_run_id(run_id)}/step_{_step(step)}"


def _step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a step is a non-negative integer, got {step!r}")
    return step


# --- the channel table -----------------------------------------------------------------------


@dataclass(frozen=True)
class Channel:
    """One row of DESIGN.md's subject table, as the AsyncAPI document describes it.

    ``address`` writes a variable token as ``{run_id}`` or ``{service}`` (AsyncAPI's form).
    ``stream`` is None for core-NATS request/reply, whose ``reply`` lists the answer's events.
    """

    id: str
    address: str
    stream: str | None
    messages: tuple[type[Event], ...]
    producers: str
    consumers: str
    summary: str
    reply: tuple[type[Event], ...] = ()
    queue_group: str | None = None

    @property
    def parameters(self) -> tuple[str, ...]:
        return tuple(re.findall(r"\{(\w+)\}", self.address))


CHANNELS: tuple[Channel, ...] = (
    Channel(
        "runs_submit",
        SUBMIT,
        RUNS_STREAM,
        (RunSubmitted,),
        producers="any client: plexrl submit, an orchestrator, Node.js, curl",
        consumers="registry",
        summary="a client asks for a run",
    ),
    Channel(
        "runs_discovered",
        DISCOVERED,
        RUNS_STREAM,
        (RunDiscovered,),
        producers="registry",
        consumers="trainer and inference run mirrors, orchestrators",
        summary="a run passed validation and holds an index",
    ),
    Channel(
        "runs_invalid",
        INVALID,
        RUNS_STREAM,
        (RunConfigInvalid,),
        producers="registry",
        consumers="orchestrators, operators",
        summary="a run's config was rejected",
    ),
    Channel(
        "runs_evict",
        EVICT,
        RUNS_STREAM,
        (EvictRequested,),
        producers="trainer (bad data, divergence), plexrl evict, any client",
        consumers="registry",
        summary="someone asks the registry to evict a run",
    ),
    Channel(
        "runs_evicted",
        EVICTED,
        RUNS_STREAM,
        (RunEvicted,),
        producers="registry",
        consumers="run mirrors (deletion hooks), the run's orchestrator",
        summary="a run was evicted and its index is free",
    ),
    Channel(
        "runs_forgotten",
        FORGOTTEN,
        RUNS_STREAM,
        (RunForgotten,),
        producers="registry",
        consumers="run mirrors (deletion hooks), orchestrators",
        summary="a run's directory disappeared and its index is free",
    ),
    Channel(
        "rollouts",
        _ROLLOUTS_PREFIX + "{run_id}",
        ROLLOUTS_STREAM,
        (RolloutBatch,),
        producers="the run's orchestrator",
        consumers="trainer",
        summary="the samples of one step of one run",
    ),
    Channel(
        "weights",
        _WEIGHTS_PREFIX + "{run_id}",
        WEIGHTS_STREAM,
        (WeightsReady,),
        producers="trainer",
        consumers="inference (loads the adapter), orchestrators",
        summary="a run's adapter after a number of optimizer steps is ready",
    ),
    Channel(
        "inference_generate",
        GENERATE,
        None,
        (GenerateRequest,),
        producers="orchestrators, any client",
        consumers="inference replicas",
        summary="completions with per-token log-probabilities under a run's adapter",
        reply=(GenerateResponse,),
        queue_group=INFERENCE_QUEUE_GROUP,
    ),
    Channel(
        "inference_cancel",
        CANCEL,
        None,
        (GenerateCancel,),
        producers="the gateway",
        consumers="every inference replica (no queue group)",
        summary="a generate request's requester gave up: the replica holding it drops it",
    ),
    Channel(
        "inference_generate_progress",
        "{progress_subject}",
        None,
        (GenerateProgress,),
        producers="the inference replica holding a request that names a progress_subject",
        consumers="the requester",
        summary="a generate request is still held (waiting for its policy version or "
        "generating); sent to the request's progress_subject until the reply is sent",
    ),
    Channel(
        "registry_list",
        REGISTRY_LIST,
        None,
        (RunListRequest,),
        producers="plexrl runs, dashboards, any client",
        consumers="registry",
        summary="the run table with each run's progress; a tenant asks on "
        "plexrl.registry.<tenant>.list and sees only its own runs",
        reply=(RunList,),
    ),
    Channel(
        "errors",
        _ERRORS_PREFIX + "{service}",
        ERRORS_STREAM,
        (InvalidMessage, ServiceError),
        producers="any service",
        consumers="operators, dashboards",
        summary="messages a service rejected and failures it survived",
    ),
    Channel(
        "collective_join",
        _COLLECTIVE_PREFIX + "{group}.join",
        None,
        (JoinRequest,),
        producers="inference replicas (collective weight transport)",
        consumers="the trainer's collective sender",
        summary="a replica asks to receive weight broadcasts; a request that does not decode is "
        "answered with a ServiceError saying why",
        reply=(GroupState, ServiceError),
    ),
    Channel(
        "collective_leave",
        _COLLECTIVE_PREFIX + "{group}.leave",
        None,
        (LeaveRequest,),
        producers="inference replicas (collective weight transport)",
        consumers="the trainer's collective sender",
        summary="a replica leaves the broadcast group; a request that does not decode is answered "
        "with a ServiceError saying why",
        reply=(GroupState, ServiceError),
    ),
    Channel(
        "collective_formed",
        _COLLECTIVE_PREFIX + "{group}.formed",
        None,
        (GroupFormed,),
        producers="the trainer's collective sender",
        consumers="every replica of the group",
        summary="a new generation of the broadcast group is being built",
    ),
    Channel(
        "collective_alive",
        _COLLECTIVE_PREFIX + "{group}.alive.{member}",
        None,
        (Ping,),
        producers="the trainer's collective sender",
        consumers="the member named in the subject",
        summary="is this member still there?",
        reply=(Pong,),
    ),
)

CHANNELS += tuple(
    Channel(
        f"train_{kind}",
        train_subject(kind),
        None,
        (request,),
        producers="the gateway, any client",
        consumers="trainer",
        summary=f"{summary}; a tenant asks on plexrl.train.<tenant>.{kind}",
        reply=(result,),
    )
    for kind, (request, result, summary) in TRAIN_COMMANDS.items()
)

CHANNELS += tuple(
    Channel(
        f"ingest_{kind}",
        f"{INGEST_FAMILY}.{{tenant}}.{kind}" + (".{run_id}" if kind == "rollouts" else ""),
        None,
        (event,),
        producers=f"a tenant's clients, publishing on {seen} in their own account (mapped here)",
        consumers="registry (checks the write and stores it on the stream subject of that name)",
        summary=f"a tenant's {event.__name__}; the reply is the stream's acknowledgement or an "
        "error saying why nothing was stored (schemas/ingest.py)",
        queue_group=INGEST_QUEUE_GROUP,
    )
    for kind, event, seen in (
        ("submit", RunSubmitted, "plexrl.runs.<tenant>.submit"),
        ("evict", EvictRequested, "plexrl.runs.<tenant>.evict"),
        ("rollouts", RolloutBatch, "plexrl.rollouts.<tenant>.<run_id>"),
    )
)
