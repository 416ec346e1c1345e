"""A tenant's views of its runs' events: streams in the tenant's own account, kept by the services.

A tenant's account imports the lifecycle events and WeightsReady of its runs as core messages
(:mod:`services.tenants.accounts`). Two streams in that account store them, under the names and
subjects the services' streams have, so a tenant's client follows its runs (``Follower``),
reads the last announcement (``get_last_msg``) and replays what happened before it connected
with exactly the code a client of the services account uses:

- ``PLEXRL_RUNS``: ``plexrl.runs.<t>.discovered|invalid|evicted|forgotten`` (its submits and
  evicts are requests, answered by the registry, and never stored here);
- ``PLEXRL_WEIGHTS``: ``plexrl.weights.<t>.>``, the newest 8 announcements per run.

The registry creates or restores them through the tenant's JetStream API, which the tenant's
account exports to the services account alone (:func:`~services.tenants.accounts.tenant_js_prefix`):
at start, when the tenants file changes, and before it stores a tenant's submit. Their bytes
count against the tenant's own JetStream storage; old events give way to new ones.
"""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import ServiceUnavailableError

from schemas import subjects as sj
from schemas.tenant import validate_tenant
from services.bus.provision import WEIGHTS_PER_RUN, StreamSpec, ensure_stream
from services.tenants.accounts import tenant_js_prefix

RUNS_VIEW_BYTES = 16 * 1024 * 1024
WEIGHTS_VIEW_BYTES = 8 * 1024 * 1024
VIEW_BYTES = RUNS_VIEW_BYTES + WEIGHTS_VIEW_BYTES
"""What the views reserve of a tenant's JetStream storage (its quota is at least 64 MiB)."""


class ViewsUnavailable(RuntimeError):
    """The tenant's JetStream API does not answer: the server does not run the accounts of
    ``plexrl nats-config`` (no authentication, or an older single-account config), or does not
    know this tenant yet (its config was not reloaded)."""


def view_specs(tenant: str) -> tuple[StreamSpec, ...]:
    """The streams :func:`ensure_views` keeps in ``tenant``'s account."""
    t = validate_tenant(tenant)
    return (
        StreamSpec(
            sj.RUNS_STREAM,
            tuple(sj.runs_subject(kind, t) for kind in sj.LIFECYCLE_KINDS),
            f"the lifecycle events of tenant {t}'s runs (kept by the plexrl registry)",
            max_bytes=RUNS_VIEW_BYTES,
            discard=api.DiscardPolicy.OLD,
        ),
        StreamSpec(
            sj.WEIGHTS_STREAM,
            (f"plexrl.weights.{t}.>",),
            f"the WeightsReady announcements of tenant {t}'s runs (kept by the plexrl registry)",
            max_bytes=WEIGHTS_VIEW_BYTES,
            max_msgs_per_subject=WEIGHTS_PER_RUN,
            discard=api.DiscardPolicy.OLD,
        ),
    )


async def ensure_views(nc: NATS, tenant: str, timeout: float = 5.0) -> list[str]:
    """Create or restore ``tenant``'s views (see the module docstring); what changed.

    :class:`ViewsUnavailable` when the tenant's JetStream API does not answer.
    """
    js = nc.jetstream(prefix=tenant_js_prefix(tenant), timeout=timeout)
    changed = []
    for spec in view_specs(tenant):
        try:
            done = await ensure_stream(js, spec)
        except (NoRespondersError, ServiceUnavailableError, NatsTimeout) as exc:
            raise ViewsUnavailable(
                f"tenant {tenant}: its account's JetStream API does not answer "
                f"({type(exc).__name__}); is the server running the accounts of `plexrl "
                "nats-config`, reloaded since the tenant was added?"
            ) from None
        if done is not None:
            changed.append(f"tenant {tenant}: {done}")
    return changed
