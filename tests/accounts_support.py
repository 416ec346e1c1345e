"""A nats-server running the accounts config of ``plexrl nats-config``, for the tests.

:func:`accounts_broker` runs ``plexrl tenants add`` for each tenant and ``plexrl nats-config``
(the CLI itself, in this process), starts a real nats-server on the config it wrote and connects
clients as any of its users: the services, the gateway or a tenant (each a
:class:`~services.bus.Bus` acting for that tenant, with its inbox prefix).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.bus import Bus, EmbeddedNats, free_port
from services.config import process_settings
from services.config.tenants import TenantQuota
from services.tenants.credentials import GATEWAY, SERVICES, key_path, seed_path


@dataclass
class AccountsBroker:
    server: EmbeddedNats
    auth: Path
    """the tenants file, the seeds and the API keys"""

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def tenants_file(self) -> Path:
        return self.auth / "tenants.toml"

    def seed(self, who: str) -> Path:
        return seed_path(self.auth, who)

    def api_key(self, tenant: str) -> str:
        return key_path(self.auth, tenant).read_text().strip()

    def env(self, who: str) -> dict[str, str]:
        """The environment a process acting as ``who`` (a tenant, SERVICES or GATEWAY) runs with."""
        env = {"PLEXRL_NATS_URL": self.url, "PLEXRL_NATS_CREDS": str(self.seed(who))}
        if who not in (SERVICES, GATEWAY):
            env["PLEXRL_TENANT"] = who
        return env

    async def connect(self, who: str, service: str = "test", **kwargs: object) -> Bus:
        """A connection as ``who``: a tenant, :data:`SERVICES` or :data:`GATEWAY`."""
        tenant = who if who not in (SERVICES, GATEWAY) else "default"
        identity = process_settings(nats_creds=str(self.seed(who)), tenant=tenant)
        return await Bus.connect(self.url, service, settings=identity, **kwargs)  # type: ignore[arg-type]


def write_auth(auth: Path, tenants: dict[str, TenantQuota]) -> None:
    """The tenants file, every seed and every tenant's API key: ``plexrl tenants add``."""
    from services.cli import main

    for name, quota in tenants.items():
        flags = []
        for field, value in quota.model_dump(exclude_defaults=True).items():
            flags += [f"--{field.replace('_', '-')}", str(value)]
        assert main(["tenants", "add", name, "--dir", str(auth), *flags]) == 0


def write_config(auth: Path, port: int, store: Path) -> Path:
    """``auth/nats.conf`` for the tenants of ``auth/tenants.toml``: ``plexrl nats-config``."""
    from services.cli import main

    listen = ("--listen", f"127.0.0.1:{port}", "--store-dir", str(store))
    assert main(["nats-config", "--dir", str(auth), *listen]) == 0
    return auth / "nats.conf"


@contextlib.contextmanager
def accounts_broker(root: Path, tenants: dict[str, TenantQuota]) -> Iterator[AccountsBroker]:
    """A nats-server on the accounts of ``tenants`` (see the module docstring)."""
    auth = root / "auth"
    write_auth(auth, tenants)
    port = free_port()
    conf = write_config(auth, port, root / "store")
    with EmbeddedNats(store_dir=root / "log", port=port, config=conf) as server:
        yield AccountsBroker(server, auth)
