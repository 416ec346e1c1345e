"""The records plexrl keeps in KV buckets: the registry's run table and each run's progress.

Unlike events these are state, rewritten in place under their key (the run id), so they carry
no ``type`` tag and no ``schema_version``. Like events they are JSON objects that tolerate
unknown fields, so a writer may add fields (at the end, with defaults) and older readers keep
working; a client in any language reads them with the schemas in ``json/`` (``run_record``,
``progress``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from schemas import subjects as sj
from schemas.events import (
    Event,
    NonNegInt,
    RunConfigInvalid,
    RunDiscovered,
    RunEvicted,
    RunForgotten,
    RunId,
    RunIndex,
    Step,
    Tenant,
)
from schemas.tenant import DEFAULT_TENANT

RunStatus = Literal["waiting", "active", "invalid", "evicted", "forgotten"]
"""waiting: valid, no free index yet; active: holds ``idx``; invalid: its config was rejected;
evicted: removed on request (stays evicted); forgotten: its run directory disappeared."""
RUN_STATUSES: tuple[RunStatus, ...] = ("waiting", "active", "invalid", "evicted", "forgotten")
HOLDING_STATUSES: frozenset[RunStatus] = frozenset({"active", "waiting"})
"""The statuses of a run the registry holds with its config."""
GONE_STATUSES: frozenset[RunStatus] = frozenset({"evicted", "forgotten", "invalid"})
"""The statuses of a run whose batches and weights nobody trains or serves any more."""


class RunRecord(msgspec.Struct, kw_only=True):
    """One run as the registry knows it: the value of key ``<run_id>`` in KV ``plexrl-registry``.

    Producer: registry (the table is its write-ahead log: written before each lifecycle event,
    ``last_published`` after). Consumers: orchestrators (admission), the trainer (is a run
    gone?), ``plexrl runs`` / ``plexrl evict`` / ``plexrl submit``, any client.

    ``transition`` counts state changes of this run id and is part of every lifecycle message
    id, so the eviction of one incarnation of ``run_x`` is never mistaken by the stream's
    deduplication for the eviction of an earlier one.
    """

    run_id: RunId
    status: RunStatus
    idx: RunIndex | None = None
    config_digest: str = ""
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    file_digest: str = ""
    error: str = ""
    reason: str = ""
    released_idx: RunIndex | None = None
    """the index an eviction or disappearance freed: RunEvicted / RunForgotten announce it"""
    transition: NonNegInt = 0
    last_published: str = ""
    """the Nats-Msg-Id of the last lifecycle event published for this record"""
    queued_at: NonNegInt = 0
    """waiting runs get an index smallest first (time.time_ns at first wait)"""
    submit_seq: NonNegInt = 0
    """stream sequence of the last RunSubmitted applied (an older one changes nothing)"""
    source: str = ""
    updated_at: float = 0.0
    """wall-clock time of the write, seconds since the epoch"""
    tenant: Tenant = DEFAULT_TENANT
    """the tenant that owns the run (fixed by its first submit; the broker vouches for it)"""

    def lifecycle_event(self) -> tuple[str, str, Event] | None:
        """(subject, Nats-Msg-Id, event) this state owes the stream, or None."""
        rid, n, tenant = self.run_id, self.transition, self.tenant
        match self.status:
            case "active" if self.idx is not None:
                short = self.config_digest.removeprefix("sha256:")[:16]
                event: Event = RunDiscovered(
                    run_id=rid,
                    idx=self.idx,
                    config=self.config,
                    config_digest=self.config_digest,
                    tenant=tenant,
                )
                return sj.runs_subject("discovered", tenant), f"{rid}/discovered/{n}/{short}", event
            case "invalid":
                short = self.file_digest.removeprefix("sha256:")[:16]
                event = RunConfigInvalid(run_id=rid, error=self.error[:16000], tenant=tenant)
                return sj.runs_subject("invalid", tenant), f"{rid}/invalid/{n}/{short}", event
            case "evicted" if self.released_idx is not None:
                event = RunEvicted(
                    run_id=rid, idx=self.released_idx, reason=self.reason[:16000], tenant=tenant
                )
                return sj.runs_subject("evicted", tenant), f"{rid}/evicted/{n}", event
            case "forgotten" if self.released_idx is not None:
                event = RunForgotten(run_id=rid, idx=self.released_idx, tenant=tenant)
                return sj.runs_subject("forgotten", tenant), f"{rid}/forgotten/{n}", event
        return None

    def next(self, status: RunStatus, **changes: Any) -> RunRecord:
        """The run's next state: a new transition that keeps only what ``changes`` sets and the
        bookkeeping every transition carries over."""
        return RunRecord(
            run_id=self.run_id,
            status=status,
            transition=self.transition + 1,
            last_published=self.last_published,
            submit_seq=max(self.submit_seq, changes.pop("submit_seq", 0)),
            tenant=changes.pop("tenant", self.tenant),
            **changes,
        )

    def carried(self) -> dict[str, Any]:
        """What a waiting run keeps when it gets its index."""
        return {
            "config": self.config,
            "config_digest": self.config_digest,
            "file_digest": self.file_digest,
            "queued_at": self.queued_at,
            "source": self.source,
        }

    @property
    def owes_event(self) -> bool:
        owed = self.lifecycle_event()
        return owed is not None and owed[1] != self.last_published


class Progress(msgspec.Struct, kw_only=True):
    """How far one run's training got: the value of key ``<run_id>`` in KV ``plexrl-progress``.

    Producer: trainer (rank 0, after each optimizer step of the run). Consumers: orchestrators,
    the run mirror, ``plexrl runs``, dashboards. For example::

        {"step": 12, "total_tokens": 4096, "total_samples": 768, "updated_at": 1718000000.0,
         "reward_mean": 0.5}
    """

    step: Step
    """optimizer steps taken (the run's current policy version)"""
    total_tokens: NonNegInt
    """tokens trained on, summed over every step"""
    total_samples: NonNegInt
    """samples (completions) trained on, summed over every step"""
    updated_at: float = 0.0
    """wall-clock time of the write (seconds since the epoch)"""
    reward_mean: float | None = None
    """mean reward of the last trained batch, when the writer knows it"""
    tenant: Tenant = DEFAULT_TENANT
    """the tenant that owns the run"""


ALL_RECORDS: dict[str, type[msgspec.Struct]] = {"run_record": RunRecord, "progress": Progress}
"""Each record type by the name of its schema file, ``json/<name>.json``."""
RECORD_BUCKETS: dict[str, str] = {"run_record": sj.KV_REGISTRY, "progress": sj.KV_PROGRESS}
"""The KV bucket each record type lives in."""
