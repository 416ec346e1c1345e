"""The nats-server configuration of an authenticated plexrl: accounts, nkey users, TLS, JetStream.

``render_nats_config`` writes a complete config: the settings of the embedded server of
``plexrl up`` (services/bus/server.py), or a base config copied verbatim (a deployment's own
``nats.conf``), then an ``accounts`` block (:func:`render_accounts`): the services' account
with the services' user, and one account per tenant with the tenant's user, the broker's limits
of its quota and the imports of :mod:`services.tenants.accounts`. Users are nkeys: the server
holds only public keys. Clients without a known key are refused.

Adding a tenant to a running server: regenerate the config, then reload the server twice
(``nats-server --signal reload``): nats-server (2.10 to 2.15 at least) creates a new account on
the first reload but subscribes its service imports only on the next one; a restart does both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.bus.server import MAX_PAYLOAD
from services.config.tenants import TenantQuota, load_tenants
from services.tenants.accounts import (
    GATEWAY_ACCOUNT,
    JS_API,
    SERVICES_ACCOUNT,
    tenant_account,
    tenant_js_prefix,
    tenant_shares,
)
from services.tenants.credentials import (
    GATEWAY,
    SERVICES,
    TENANTS_FILE,
    ensure_seed,
    public_key,
    seed_path,
)


@dataclass(frozen=True)
class User:
    """One NATS user: who it is (a tenant, or the services), its public key and, for a tenant,
    its quota (the limits of its account)."""

    name: str
    nkey: str
    quota: TenantQuota | None = None


@dataclass(frozen=True)
class Tls:
    """The server's certificate and key; ``ca`` verifies clients' certificates when ``verify``."""

    cert: Path
    key: Path
    ca: Path | None = None
    verify: bool = False


def users_of(directory: Path) -> list[User]:
    """The services' and the gateway's users (their seeds are created on first use) and every
    tenant of ``directory/tenants.toml``, whose seed files must exist."""
    directory = Path(directory)
    tenants = load_tenants(directory / TENANTS_FILE).tenants
    # every tenant's seed first: a missing one is an error before anything is written
    users = [User(n, public_key(seed_path(directory, n)), tenants[n]) for n in sorted(tenants)]
    services_key, _ = ensure_seed(seed_path(directory, SERVICES))
    gateway_key, _ = ensure_seed(seed_path(directory, GATEWAY))
    return [User(SERVICES, services_key), User(GATEWAY, gateway_key), *users]


def _quote(value: str | Path) -> str:
    # Double quotes keep '$JS...' from being read as a variable reference.
    return json.dumps(str(value))


def _service_import(account: str, subject: str, to: str) -> str:
    mapped = f", to: {_quote(to)}" if to != subject else ""
    return f"{{ service: {{ account: {_quote(account)}, subject: {_quote(subject)} }}{mapped} }}"


def _stream_import(account: str, subject: str, to: str) -> str:
    mapped = f", to: {_quote(to)}" if to != subject else ""
    return f"{{ stream: {{ account: {_quote(account)}, subject: {_quote(subject)} }}{mapped} }}"


def _block(name: str, lines: list[str]) -> list[str]:
    return [f"    {name}: [", *(f"      {line}" for line in lines), "    ]"]


def _services_account(services: User, tenants: list[User]) -> list[str]:
    exports: list[str] = []
    imports: list[str] = []
    for user in tenants:
        account = _quote(tenant_account(user.name))
        exports.append(f"# tenant {user.name}")
        for share in tenant_shares(user.name):
            exports.append(
                f"{{ {share.kind}: {_quote(share.services_subject)}, accounts: [{account}] }}"
            )
        imports.append(
            _service_import(
                tenant_account(user.name), f"{JS_API}.>", f"{tenant_js_prefix(user.name)}.>"
            )
        )
    lines = [
        f"  {_quote(SERVICES_ACCOUNT)}: {{",
        "    # the services: every stream, KV bucket and object store lives here",
        "    jetstream: enabled",
        f"    users: [ {{ nkey: {_quote(services.nkey)} }} ]",
    ]
    if exports:
        lines += _block("exports", exports)
    if imports:
        lines += _block("imports", imports)
    return [*lines, "  }"]


def _tenant_account(user: User) -> list[str]:
    quota = user.quota or TenantQuota()
    limits = [
        f"max_connections: {quota.max_connections}",
        f"max_subscriptions: {quota.max_subscriptions}",
    ]
    if quota.max_payload is not None:
        limits.append(f"max_payload: {quota.max_payload}")
    jetstream = (
        f"max_file: {quota.max_store_bytes}, max_mem: {quota.max_memory_bytes}, "
        f"max_streams: {quota.max_streams}, max_consumers: {quota.max_consumers}"
    )
    imports = []
    for share in tenant_shares(user.name):
        render = _service_import if share.kind == "service" else _stream_import
        imports.append(render(SERVICES_ACCOUNT, share.services_subject, share.tenant_subject))
    return [
        f"  {_quote(tenant_account(user.name))}: {{",
        f"    # tenant {user.name}",
        f"    jetstream: {{ {jetstream} }}",
        f"    limits: {{ {', '.join(limits)} }}",
        f"    users: [ {{ nkey: {_quote(user.nkey)} }} ]",
        # the registry keeps this account's views of its runs' events (PLEXRL_RUNS, ...)
        *_block(
            "exports",
            [f"{{ service: {_quote(JS_API + '.>')}, accounts: [{_quote(SERVICES_ACCOUNT)}] }}"],
        ),
        *_block("imports", imports),
        "  }",
    ]


def render_accounts(users: list[User]) -> str:
    """The ``accounts`` block: the services' account, the gateway's and one per tenant."""
    services = next(u for u in users if u.name == SERVICES)
    tenants = [u for u in users if u.name not in (SERVICES, GATEWAY)]
    lines = ["accounts {", *_services_account(services, tenants)]
    gateway = next((u for u in users if u.name == GATEWAY), None)
    if gateway is not None:
        lines += [
            f"  {_quote(GATEWAY_ACCOUNT)}: {{",
            "    # the gateway's own connection: health checks only (it acts as each tenant)",
            "    limits: { max_connections: 64 }",
            f"    users: [ {{ nkey: {_quote(gateway.nkey)} }} ]",
            "  }",
        ]
    for user in tenants:
        lines += _tenant_account(user)
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_tls(tls: Tls) -> str:
    """The ``tls`` block: clients must speak TLS; with ``verify`` they need a certificate too."""
    lines = ["tls {", f"  cert_file: {_quote(tls.cert)}", f"  key_file: {_quote(tls.key)}"]
    if tls.ca is not None:
        lines.append(f"  ca_file: {_quote(tls.ca)}")
    if tls.verify:
        lines.append("  verify: true")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_base(listen: str, store_dir: Path) -> str:
    """Listen address, payload limit and JetStream, as the embedded server has them."""
    return (
        f"listen: {_quote(listen)}\n"
        f"max_payload: {MAX_PAYLOAD}\n"
        "jetstream {\n"
        f"  store_dir: {_quote(store_dir)}\n"
        # flush every acknowledged write: a crash loses nothing a publisher was told is stored
        "  sync_interval: always\n"
        "}\n"
    )


def render_nats_config(
    users: list[User],
    *,
    base: str | None = None,
    listen: str = "0.0.0.0:4222",
    store_dir: Path = Path("plexrl-jetstream"),
    tls: Tls | None = None,
) -> str:
    """A complete nats-server config: ``base`` (or :func:`render_base`), accounts, TLS."""
    parts = [
        "# Written by `plexrl nats-config`: regenerate it after `plexrl tenants add/remove`, then\n"
        "# reload the server twice (nats-server --signal reload) or restart it.\n",
        base if base is not None else render_base(listen, store_dir),
        render_accounts(users),
    ]
    if tls is not None:
        parts.append(render_tls(tls))
    return "\n".join(p if p.endswith("\n") else p + "\n" for p in parts)


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` so that a reader (a starting server) never sees half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.chmod(mode)
    tmp.replace(path)
