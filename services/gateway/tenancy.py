"""Who an HTTP request acts for: API keys, one NATS identity per tenant, and per-key limits.

With a tenants file (``tenants_file``) every request but the health checks carries a tenant's
API key, as the ``tinker`` SDK (``X-API-Key``) and the ``openai`` client (``Authorization:
Bearer``) send it. The key's SHA-256 is looked up in the tenants file, which is read again when
it changes (a new tenant, a rotated key); a missing or unknown key is a 401 in the API's own
error shape, and the request goes no further. A request then acts for its key's tenant only:
its :class:`~services.gateway.backend.Backend` reaches NATS with that tenant's own nkey
(``DIR/<tenant>.nk`` beside the tenants file), in the tenant's own account, so even a gateway
bug cannot name another tenant's runs; the broker would not route it.

Without a tenants file the gateway acts for the tenant of its own credentials with no key at
all, and refuses to listen anywhere but on loopback unless told (``allow_no_keys``).

Each key may have ``max_concurrent_per_key`` requests and Tinker futures under way at once;
past that, a request is answered 429 at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from services.config.tenants import TenantsFileError, load_tenants
from services.gateway.backend import Backend, GatewayError
from services.gateway.futures import Counter
from services.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

RELOAD_EVERY_S = 1.0
"""how often at most the tenants file's modification time is looked at"""


class Unauthorized(GatewayError):
    def __init__(self, message: str) -> None:
        super().__init__(401, message, "invalid_api_key")


def presented_key(headers: dict[str, str]) -> str | None:
    """The API key a request carries: ``X-API-Key``, or ``Authorization: Bearer <key>``."""
    key = headers.get("x-api-key")
    if key:
        return key.strip()
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class KeyTable:
    """The tenants file's key digests, read again when the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._by_digest: dict[str, str] = {}
        self._reload()

    def _reload(self) -> None:
        try:
            st = self.path.stat()
        except OSError:
            stamp = None
        else:
            stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp and self._by_digest:
            return
        try:
            tenants = load_tenants(self.path)
        except TenantsFileError as exc:  # keep the keys we had: a half-edited file is no outage
            log.error("gateway: keeping the API keys it had: %s", exc)
            return
        self._stamp = stamp
        self._by_digest = {
            q.api_key_sha256: name for name, q in tenants.tenants.items() if q.api_key_sha256
        }
        log.info("gateway: %d tenants with an API key in %s", len(self._by_digest), self.path)

    def tenant_of(self, key: str) -> str | None:
        """The tenant whose key ``key`` is, or None."""
        from services.tenants.credentials import api_key_digest

        now = time.monotonic()
        if now - self._checked >= RELOAD_EVERY_S:
            self._checked = now
            self._reload()
        # a dict lookup by the key's digest: nothing here depends on how much of a wrong key
        # matches a right one
        return self._by_digest.get(api_key_digest(key))


class Tenancy(Counter):
    """The tenant of each request, the backend of each tenant and the per-key counts."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        default: Backend | None = None,
        connect: Callable[[str], Awaitable[Backend]] | None = None,
    ) -> None:
        self.settings = settings
        self.keys = KeyTable(settings.tenants_file) if settings.tenants_file else None
        self._default = default
        self._connect = connect
        self._backends: dict[str, Backend] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._under_way: dict[str, int] = {}

    @property
    def keyed(self) -> bool:
        return self.keys is not None

    def tenant_of(self, headers: dict[str, str]) -> str:
        """The tenant a request acts for; :class:`Unauthorized` without a valid key."""
        if self.keys is None:
            assert self._default is not None
            return self._default.tenant
        key = presented_key(headers)
        if key is None:
            raise Unauthorized(
                "this gateway needs an API key: send it as X-API-Key or 'Authorization: Bearer "
                "<key>' (the tinker SDK's api_key / TINKER_API_KEY, the openai client's api_key)"
            )
        tenant = self.keys.tenant_of(key)
        if tenant is None:
            raise Unauthorized("the API key is not valid here")
        return tenant

    async def backend(self, tenant: str) -> Backend:
        """``tenant``'s backend, connecting it on first use."""
        if self.keys is None:
            assert self._default is not None
            return self._default
        found = self._backends.get(tenant)
        if found is not None:
            return found
        lock = self._connecting.setdefault(tenant, asyncio.Lock())
        async with lock:
            found = self._backends.get(tenant)
            if found is None:
                assert self._connect is not None
                found = self._backends[tenant] = await self._connect(tenant)
        return found

    def connected(self) -> list[Backend]:
        """Every tenant's backend connected so far (the default one without a tenants file)."""
        if self.keys is None:
            return [self._default] if self._default is not None else []
        return list(self._backends.values())

    def begin(self, tenant: str) -> None:
        """Count one more request or future of ``tenant``; 429 past the limit."""
        count = self._under_way.get(tenant, 0)
        limit = self.settings.max_concurrent_per_key
        if count >= limit:
            raise GatewayError(
                429,
                f"this API key has {count} requests under way, the most this gateway allows "
                f"(max_concurrent_per_key = {limit}); wait for some to finish",
                "rate_limit_exceeded",
            )
        self._under_way[tenant] = count + 1

    def end(self, tenant: str) -> None:
        left = self._under_way.get(tenant, 1) - 1
        if left > 0:
            self._under_way[tenant] = left
        else:
            self._under_way.pop(tenant, None)

    async def close(self) -> None:
        backends, self._backends = list(self._backends.values()), {}
        for backend in backends:
            await backend.bus.close()
