"""The tenant-name rule, stated once.

A tenant owns runs. Its name is a NATS subject token (the broker's permissions are written
over it) and part of an inbox prefix, so it follows the run-id character rule without the
``run_`` prefix: 1 to 64 letters, digits, ``_`` or ``-``. ``default`` is the tenant of every run
when no tenants are configured; its runs keep the subjects plexrl had before tenants existed.
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
