"""The tenant-name rule, stated once.

A tenant owns runs. Its name is a NATS subject token (the broker's permissions are written
over it) and part of an inbox prefix, so it follows the run-id character rule without the
``run_`` prefix: 1 to 64 letters, digits, ``_`` or ``-``. ``default`` is the tenant of every run
when no tenants are configured; its runs keep the subjects plexrl had before tenants existed.

The inboxes follow the tenant: the default tenant's clients use NATS's ``_INBOX``, a tenant's
``_INBOX_<tenant>``. A GenerateRequest's ``progress_subject`` must be one of them
(:func:`check_progress_subject`), so a requester cannot make a replica publish elsewhere.
"""

from __future__ import annotations

import re

DEFAULT_TENANT = "default"
TENANT_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_TENANT_RE = re.compile(TENANT_PATTERN)


class InvalidTenant(ValueError):
    """A string that is not a legal tenant name."""


def is_valid_tenant(value: object) -> bool:
    return (
        isinstance(value, str)
        and _TENANT_RE.fullmatch(value) is not None
        and not value.startswith("run_")
    )


def validate_tenant(value: object) -> str:
    """Return ``value`` if it is a legal tenant name, else raise :class:`InvalidTenant`."""
    if not is_valid_tenant(value):
        shown = repr(value)[:80]
        raise InvalidTenant(
            f"illegal tenant name {shown}: a tenant name is 1-64 letters, digits, '_' or '-' "
            "and does not start with 'run_'"
        )
    assert isinstance(value, str)
    return value


def inbox_prefix(tenant: str) -> str:
    """The reply-subject prefix a tenant's clients use, the only inboxes they may subscribe to."""
    return f"_INBOX_{validate_tenant(tenant)}"


DEFAULT_INBOX_PREFIX = "_INBOX"
"""The reply-subject prefix of NATS clients (and of the services and default-tenant clients)."""

_INBOX_REST_RE = re.compile(r"[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64}){0,7}")


def progress_inbox_prefix(tenant: str = DEFAULT_TENANT) -> str:
    """The prefix every ``GenerateRequest.progress_subject`` on ``tenant``'s generate subject
    has: ``_INBOX.``, or ``_INBOX_<tenant>.`` (the only inboxes the tenant's credentials may
    subscribe to)."""
    if tenant == DEFAULT_TENANT:
        return DEFAULT_INBOX_PREFIX + "."
    return inbox_prefix(tenant) + "."


def check_progress_subject(subject: str, tenant: str = DEFAULT_TENANT) -> str:
    """Return ``subject`` if a replica may publish progress of a request of ``tenant`` there.

    Only an inbox of the requester qualifies: the tenant's inbox prefix, then 1-8 tokens of
    letters, digits, '_' or '-' (no wildcard, no empty token). Anything else would let a
    requester make the replica publish on subjects it does not own: ``ValueError`` saying so.
    """
    prefix = progress_inbox_prefix(tenant)
    if not subject.startswith(prefix) or not _INBOX_REST_RE.fullmatch(subject[len(prefix) :]):
        shown = repr(subject)[:100]
        raise ValueError(
            f"progress_subject {shown} is refused: a replica publishes progress only to an inbox "
            f"of the requester, a subject under {prefix} (tenant {tenant}); subscribe a fresh "
            "inbox of your connection (nats-py: nc.new_inbox()) and name it, or leave "
            "progress_subject out"
        )
    return subject
