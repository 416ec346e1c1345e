"""Where a tenant's writes arrive in the services account: the ingest subjects.

With accounts (``plexrl nats-config``), a tenant's account imports its submit, evict and
rollouts subjects as *services* of the services account, mapped onto ingest subjects that carry
the tenant as a token the broker writes, never the tenant::

    tenant's account                      services account
    plexrl.runs.<t>.submit            ->  plexrl.ingest.<t>.submit
    plexrl.runs.<t>.evict             ->  plexrl.ingest.<t>.evict
    plexrl.rollouts.<t>.<run_id>      ->  plexrl.ingest.<t>.rollouts.<run_id>

The registry answers these (services/registry/ingest.py): it checks the write, stores it on the
stream subject of the same name in the services account (``plexrl.runs.<t>.submit``...) with a
message id of its own making, prefixed by the tenant, and answers with the stream's
acknowledgement. So a tenant's client publishes exactly as before (a JetStream publish waiting
for its acknowledgement), no tenant ever writes to a services' stream, and no tenant's message
id can collide with another tenant's or the services' in a stream's deduplication window.

Without accounts (a server with no authentication, as ``plexrl up`` runs it) nothing maps onto
these subjects: every client writes to the streams directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from schemas.run_id import validate_run_id
from schemas.tenant import validate_tenant

INGEST_FAMILY = "plexrl.ingest"
INGEST_WILDCARD = "plexrl.ingest.>"
INGEST_KINDS = ("submit", "evict", "rollouts")
INGEST_QUEUE_GROUP = "registry-ingest"

_MSG_ID_RE = re.compile(r"^[\x21-\x7e]{1,200}$")


@dataclass(frozen=True)
class IngestSubject:
    """What an ingest subject names: the tenant, the kind of write and (rollouts) the run."""

    tenant: str
    kind: str
    run_id: str | None = None


def ingest_subject(tenant: str, kind: str, run_id: str | None = None) -> str:
    """``plexrl.ingest.<tenant>.submit``, ``.evict`` or ``.rollouts.<run_id>``."""
    t = validate_tenant(tenant)
    if kind == "rollouts":
        if run_id is None:
            raise ValueError("a rollouts ingest subject names a run")
        return f"{INGEST_FAMILY}.{t}.rollouts.{validate_run_id(run_id)}"
    if kind not in INGEST_KINDS or run_id is not None:
        raise ValueError(f"unknown ingest kind {kind!r} (one of {', '.join(INGEST_KINDS)})")
    return f"{INGEST_FAMILY}.{t}.{kind}"


def ingest_import(tenant: str, kind: str) -> str:
    """The subject a tenant's account imports for ``kind`` (a wildcard for the runs of
    ``rollouts``): what :func:`ingest_subject` is in the services account."""
    t = validate_tenant(tenant)
    if kind == "rollouts":
        return f"{INGEST_FAMILY}.{t}.rollouts.*"
    return ingest_subject(t, kind)


def parse_ingest_subject(subject: str) -> IngestSubject:
    """The parts of an ingest subject; ``ValueError`` for anything else."""
    tokens = subject.split(".")
    if tokens[:2] == ["plexrl", "ingest"] and len(tokens) >= 4:
        tenant = validate_tenant(tokens[2])
        if len(tokens) == 4 and tokens[3] in ("submit", "evict"):
            return IngestSubject(tenant, tokens[3])
        if len(tokens) == 5 and tokens[3] == "rollouts":
            return IngestSubject(tenant, "rollouts", validate_run_id(tokens[4]))
    raise ValueError(
        f"{subject[:200]!r} is not an ingest subject (plexrl.ingest.<tenant>.submit, .evict or "
        ".rollouts.<run_id>)"
    )


def ingest_msg_id(tenant: str, client_msg_id: str | None) -> str | None:
    """The ``Nats-Msg-Id`` the registry stores a tenant's write under: the client's own id,
    prefixed by the tenant (``acme/run_x/step_3``), or None when the client set none or one that
    is not printable ASCII of at most 200 characters. A tenant name never starts with ``run_``
    and the services' ids always do, so no tenant can name another's or the services' id."""
    if not client_msg_id or not _MSG_ID_RE.fullmatch(client_msg_id):
        return None
    return f"{validate_tenant(tenant)}/{client_msg_id}"
