"""What each NATS user may do: the services' user and one user per tenant, stated once.

The broker enforces these lists (``plexrl nats-config`` writes them into the server's
config), so the tenant a service reads from a subject is the tenant the broker authenticated.
Everything a list does not allow is denied. Each entry was measured against a real
nats-server (tests/bus/test_auth_broker.py), including what nats-py and the Node.js client send
for the operations a tenant needs:

- publishing its own requests and rollouts (JetStream publish: the acknowledgement comes back on
  the tenant's own inbox prefix);
- hearing the progress of its generate requests: a replica (the services' user) publishes it to
  the request's ``progress_subject``, which must be an inbox under the tenant's own prefix;
- following its own runs, weights and rollouts with ordered consumers: a consumer create whose
  API subject names a filter inside the tenant's subjects (the server refuses a create whose
  body filter differs from the subject's), and the flow-control replies of those consumers;
- reading, never writing, its own weights object store (stream info, message get, direct get,
  an ordered consumer on that stream alone).

Deliberately absent:

- direct get on the shared streams (PLEXRL_RUNS, PLEXRL_ROLLOUTS, PLEXRL_WEIGHTS). The server
  sends a direct-get answer to whatever reply subject the requester names, and a stream stores
  it like any publish: measured, a tenant's own RunSubmitted, fetched with the reply subject
  ``plexrl.runs.submit``, is stored on the default tenant's submit subject. A tenant reads the
  last message of its subjects with an ordered consumer (deliver last per subject) instead,
  whose deliveries streams never store.
- ``$JS.API.STREAM.NAMES`` / ``LIST`` (they name every tenant's object store). nats-py's
  ``ObjectStore.get`` looks the stream up that way, so a tenant reads an object with
  ``get_info`` and an ordered consumer bound to ``OBJ_plexrl-weights-<tenant>``.
- anything on the KV buckets, ``plexrl.errors.>``, other tenants' subjects and ``_INBOX.>``.

What the broker cannot stop: JetStream acknowledgements and API answers also go to the reply
subject a tenant names, so a tenant can make the server publish such a fixed-shape answer
(``{"stream": ..., "seq": ...}``) on any subject; services reject it as an invalid message.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import subjects as sj
from schemas.tenant import inbox_prefix, validate_tenant

API = "$JS.API"


@dataclass(frozen=True)
class Permissions:
    """The subjects a user may publish to and subscribe to; ``None`` lists allow everything."""

    publish: tuple[str, ...] | None
    subscribe: tuple[str, ...] | None
    allow_responses: bool = False


def object_store_stream(tenant: str) -> str:
    """The stream behind a tenant's weights object store: ``OBJ_plexrl-weights-<tenant>``."""
    return f"OBJ_{sj.weights_bucket(tenant)}"


def services_permissions() -> Permissions:
    """The services' user: every subject (they answer every tenant's requests)."""
    return Permissions(publish=None, subscribe=None, allow_responses=True)


def tenant_permissions(tenant: str) -> Permissions:
    """Exactly what tenant ``tenant``'s user may do; the table of deploy/README.md."""
    t = validate_tenant(tenant)
    store = object_store_stream(t)
    publish = (
        # requests and data of its own runs
        f"plexrl.runs.{t}.submit",
        f"plexrl.runs.{t}.evict",
        f"plexrl.rollouts.{t}.*",
        f"plexrl.inference.{t}.generate",
        f"plexrl.registry.{t}.list",
        f"plexrl.train.{t}.*",
        # ordered consumers on its own subjects (the filter is part of the API subject)
        f"{API}.CONSUMER.CREATE.{sj.RUNS_STREAM}.*.plexrl.runs.{t}.>",
        f"{API}.CONSUMER.CREATE.{sj.WEIGHTS_STREAM}.*.plexrl.weights.{t}.>",
        f"{API}.CONSUMER.CREATE.{sj.ROLLOUTS_STREAM}.*.plexrl.rollouts.{t}.>",
        # flow-control replies of those ordered consumers
        f"$JS.FC.{sj.RUNS_STREAM}.>",
        f"$JS.FC.{sj.WEIGHTS_STREAM}.>",
        f"$JS.FC.{sj.ROLLOUTS_STREAM}.>",
        f"$JS.FC.{store}.>",
        # read-only access to its own weights object store
        f"{API}.STREAM.INFO.{store}",
        f"{API}.STREAM.MSG.GET.{store}",
        f"{API}.DIRECT.GET.{store}.>",
        f"{API}.CONSUMER.CREATE.{store}",
        f"{API}.CONSUMER.CREATE.{store}.>",
    )
    subscribe = (
        f"{inbox_prefix(t)}.>",
        f"plexrl.runs.{t}.>",
        f"plexrl.weights.{t}.>",
        f"plexrl.rollouts.{t}.>",
    )
    return Permissions(publish=publish, subscribe=subscribe)
