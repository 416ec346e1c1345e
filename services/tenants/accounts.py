"""The NATS accounts of an authenticated plexrl: what the services share with each tenant.

Each tenant is a NATS account of its own, and the services are one more. Accounts share no
subject, stream, consumer or storage unless the config exports and imports it, so a tenant can
name only what its account imports, and nothing of another tenant's at all. The services
account exports to tenant ``t`` (and to ``t`` alone) exactly its slice, and ``t``'s account
imports it:

- **services** the tenant calls (request/reply; the answer comes back through the import):
  its submit, evict and rollouts publishes, mapped onto ingest subjects that the registry
  answers (:mod:`schemas.ingest`), its generate requests, its run list and its training
  commands; and read-only direct get on its own weights object store, which the tenant reaches
  as the JetStream API of domain ``plexrl`` (:data:`SERVICES_JS_PREFIX`);
- **streams** the tenant hears: the lifecycle events and WeightsReady of its runs, and the
  inbox prefix ``_INBOX_<t>`` where replicas send generate progress.

A tenant gets no JetStream API on anything the services own. What it follows with JetStream
lives in its own account: the registry keeps two streams there, ``PLEXRL_RUNS`` and
``PLEXRL_WEIGHTS``, which store the imported events of its runs
(services/registry/tenant_views.py); so a tenant's client follows and reads them with the same
code, stream names and subjects as a client of the services account. For that the tenant's
account exports its own JetStream API to the services account, which imports it under
:func:`tenant_js_prefix`.

Each tenant account carries the broker's limits from the tenants file (``max_store_bytes``,
``max_memory_bytes``, ``max_streams``, ``max_consumers``, ``max_connections``,
``max_subscriptions``, ``max_payload``): a tenant that fills its storage stops only itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from schemas import subjects as sj
from schemas.ingest import ingest_import
from schemas.tenant import inbox_prefix, validate_tenant
from schemas.training import TRAIN_FAMILY

SERVICES_ACCOUNT = "PLEXRL"
"""The services' account; it holds every stream, KV bucket and object store of DESIGN.md."""

GATEWAY_ACCOUNT = "GATEWAY"
"""The gateway's own account: no imports, no JetStream. The gateway's connection there only
answers its health checks; it reaches each tenant's runs as that tenant."""

SERVICES_JS_PREFIX = "$JS.plexrl.API"
"""Where a tenant's account sees the part of the services' JetStream API it may use (direct
get on its weights store): ``nc.jetstream(prefix=SERVICES_JS_PREFIX)``."""

JS_API = "$JS.API"


def tenant_account(tenant: str) -> str:
    """The account name of ``tenant``: ``TENANT_<tenant>`` (never the services' account)."""
    return f"TENANT_{validate_tenant(tenant)}"


def tenant_js_prefix(tenant: str) -> str:
    """Where the services account reaches ``tenant``'s JetStream API:
    ``bus.nc.jetstream(prefix=tenant_js_prefix(t))`` manages the streams of ``t``'s account."""
    return f"$JS.tenant_{validate_tenant(tenant)}.API"


def object_store_stream(tenant: str) -> str:
    """The stream behind a tenant's weights object store: ``OBJ_plexrl-weights-<tenant>``."""
    return f"OBJ_{sj.weights_bucket(tenant)}"


@dataclass(frozen=True)
class Share:
    """One subject the services account shares with a tenant: as a ``service`` (the tenant
    sends requests, the services answer) or a ``stream`` (the services publish, the tenant
    hears). ``services_subject`` is its name in the services account, ``tenant_subject`` in
    the tenant's."""

    kind: Literal["service", "stream"]
    services_subject: str
    tenant_subject: str


def tenant_shares(tenant: str) -> tuple[Share, ...]:
    """Everything tenant ``tenant``'s account imports from the services account."""
    t = validate_tenant(tenant)
    store = object_store_stream(t)
    same = [
        sj.generate_subject(t),
        sj.generate_subject(t, "cancel"),
        sj.registry_list_subject(t),
        f"{TRAIN_FAMILY}.{t}.*",
    ]
    shares = [
        Share("service", ingest_import(t, "submit"), sj.runs_subject("submit", t)),
        Share("service", ingest_import(t, "evict"), sj.runs_subject("evict", t)),
        Share("service", ingest_import(t, "rollouts"), f"plexrl.rollouts.{t}.*"),
        *(Share("service", s, s) for s in same),
        Share(
            "service", f"{JS_API}.DIRECT.GET.{store}", f"{SERVICES_JS_PREFIX}.DIRECT.GET.{store}"
        ),
        Share(
            "service",
            f"{JS_API}.DIRECT.GET.{store}.>",
            f"{SERVICES_JS_PREFIX}.DIRECT.GET.{store}.>",
        ),
        *(
            Share("stream", sj.runs_subject(k, t), sj.runs_subject(k, t))
            for k in sj.LIFECYCLE_KINDS
        ),
        Share("stream", f"plexrl.weights.{t}.>", f"plexrl.weights.{t}.>"),
        Share("stream", f"{inbox_prefix(t)}.>", f"{inbox_prefix(t)}.>"),
    ]
    return tuple(shares)
