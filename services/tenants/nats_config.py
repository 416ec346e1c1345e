"""The nats-server configuration of an authenticated plexrl: users by nkey, TLS, JetStream.

``render_nats_config`` writes a complete config: the settings of the embedded server of
``plexrl up`` (services/bus/server.py), or a base config copied verbatim (a deployment's own
``nats.conf``), then an ``authorization`` block with one user per nkey public key: the services'
user with every subject, and one user per tenant with :func:`tenant_permissions`. Users live in
the server's global account, so turning authentication on keeps the streams a server already
holds. Clients without a known key are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.bus.server import MAX_PAYLOAD
from services.config.tenants import load_tenants
from services.tenants.credentials import (
    SERVICES,
    TENANTS_FILE,
    ensure_seed,
    public_key,
    seed_path,
)
from services.tenants.permissions import Permissions, services_permissions, tenant_permissions


@dataclass(frozen=True)
class User:
    """One NATS user: who it is (a tenant, or the services), its public key, its permissions."""

    name: str
    nkey: str
    permissions: Permissions


@dataclass(frozen=True)
class Tls:
    """The server's certificate and key; ``ca`` verifies clients' certificates when ``verify``."""

    cert: Path
    key: Path
    ca: Path | None = None
    verify: bool = False


def users_of(directory: Path) -> list[User]:
    """The services' user (its seed is created on first use) and every tenant of
    ``directory/tenants.toml``, whose seed files must exist."""
    directory = Path(directory)
    services_key, _ = ensure_seed(seed_path(directory, SERVICES))
    users = [User(SERVICES, services_key, services_permissions())]
    for name in sorted(load_tenants(directory / TENANTS_FILE).tenants):
        key = public_key(seed_path(directory, name))
        users.append(User(name, key, tenant_permissions(name)))
    return users


def _quote(value: str | Path) -> str:
    # Double quotes keep '$JS...' from being read as a variable reference.
    return json.dumps(str(value))


def _subject_list(subjects: tuple[str, ...]) -> str:
    inner = "".join(f"\n          {_quote(s)}" for s in subjects)
    return f"[{inner}\n        ]"


def render_authorization(users: list[User]) -> str:
    """The ``authorization`` block: one nkey user per entry of ``users``."""
    lines = ["authorization {", "  users: ["]
    for user in users:
        who = "the services" if user.name == SERVICES else f"tenant {user.name}"
        lines.append(f"    # {who}")
        perms = user.permissions
        if perms.publish is None and perms.subscribe is None:
            lines.append(f"    {{ nkey: {_quote(user.nkey)} }}")
            continue
        lines.append(f"    {{ nkey: {_quote(user.nkey)}, permissions: {{")
        if perms.publish is not None:
            lines.append(f"        publish: {{ allow: {_subject_list(perms.publish)} }}")
        if perms.subscribe is not None:
            lines.append(f"        subscribe: {{ allow: {_subject_list(perms.subscribe)} }}")
        lines.append("    } }")
    lines += ["  ]", "}"]
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
    """A complete nats-server config: ``base`` (or :func:`render_base`), users, TLS."""
    parts = [
        "# Written by `plexrl nats-config`: regenerate it after `plexrl tenants add/remove`,\n"
        "# then reload the server (nats-server --signal reload, or restart it).\n",
        base if base is not None else render_base(listen, store_dir),
        render_authorization(users),
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
