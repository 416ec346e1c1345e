"""Credentials: one nkey seed file per tenant (and one for the services), one gateway API key per
tenant.

A seed file holds one NATS user nkey seed (``SU...``), readable by its owner only (mode 0600).
The client signs the server's nonce with it; the server's config holds only the matching
public key (``U...``), so nothing secret is stored on the server. Hand a tenant its own file;
point the services at ``services.nk`` with ``PLEXRL_NATS_CREDS``.

The directory (``./plexrl-auth`` by default) holds::

    tenants.toml     quotas per tenant (services.config.tenants) and key digests, no secrets
    services.nk      the services' seed
    gateway.nk       the gateway's own seed (its health checks; it acts with the tenants' seeds)
    <tenant>.nk      each tenant's seed
    <tenant>.key     each tenant's gateway API key (``tml-...``, mode 0600); the gateway holds
                     only its SHA-256, from tenants.toml
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import tempfile
from pathlib import Path

import nkeys

from schemas.tenant import DEFAULT_TENANT, validate_tenant

DEFAULT_DIR = Path("plexrl-auth")
TENANTS_FILE = "tenants.toml"
SERVICES = "services"
"""The name of the services' credential; no tenant may take it."""
GATEWAY = "gateway"
"""The name of the gateway's own credential (an account that reaches nothing: the gateway acts
for each tenant with that tenant's seed); no tenant may take it."""
SEED_SUFFIX = ".nk"
KEY_SUFFIX = ".key"
API_KEY_PREFIX = "tml-plexrl-"
"""API keys start with ``tml-`` because the ``tinker`` SDK accepts no other."""


class CredentialsError(ValueError):
    """A seed file that is missing, unreadable or not a NATS user seed; the message says which."""


def seed_path(directory: Path, name: str) -> Path:
    """``directory/<name>.nk`` for a tenant, or for :data:`SERVICES`."""
    if name not in (SERVICES, GATEWAY):
        validate_tenant(name)
    return Path(directory) / f"{name}{SEED_SUFFIX}"


def check_tenant_name(name: str) -> str:
    """A name ``plexrl tenants add`` accepts: a legal tenant, neither the default tenant (the
    services act for it) nor the services' credential name."""
    validate_tenant(name)
    if name in (DEFAULT_TENANT, SERVICES, GATEWAY):
        raise CredentialsError(
            f"'{name}' is reserved: the services use it; choose another tenant name"
        )
    return name


def public_key(path: Path) -> str:
    """The public key (``U...``) of the user seed in ``path``."""
    try:
        seed = Path(path).read_bytes().strip()
    except FileNotFoundError:
        raise CredentialsError(f"{path}: no such seed file") from None
    except OSError as exc:
        raise CredentialsError(f"{path}: cannot read the seed file: {exc}") from None
    try:
        prefix, _ = nkeys.decode_seed(seed)
        key = nkeys.from_seed(bytearray(seed)).public_key.decode()
    except (nkeys.ErrInvalidSeed, nkeys.ErrInvalidPrefixByte, ValueError) as exc:
        raise CredentialsError(
            f"{path}: not an nkey seed ({type(exc).__name__}); "
            "`plexrl tenants add` writes valid ones"
        ) from None
    if prefix != nkeys.PREFIX_BYTE_USER:
        raise CredentialsError(f"{path}: holds an nkey seed, but not a user's (SU...)")
    return key


def ensure_seed(path: Path) -> tuple[str, bool]:
    """Create a new user seed at ``path`` (mode 0600) unless one is there; its public key and
    whether it was created. An existing file is never overwritten: it must be a valid seed.

    Two processes racing to create the same file end with one seed, which both return.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return public_key(path), False
    # Write the whole seed under a private name, then link it into place: the link fails if the
    # name exists, and a reader never sees a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER) + b"\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            return public_key(path), False
    finally:
        os.unlink(tmp)
    return public_key(path), True


def key_path(directory: Path, name: str) -> Path:
    """``directory/<name>.key``: a tenant's gateway API key."""
    return Path(directory) / f"{validate_tenant(name)}{KEY_SUFFIX}"


def new_api_key() -> str:
    """A fresh API key: ``tml-plexrl-`` and 256 random bits (43 URL-safe characters)."""
    return API_KEY_PREFIX + base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")


def api_key_digest(key: str) -> str:
    """The SHA-256 (hex) of an API key: what the tenants file and the gateway hold."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_matches(key: str, digest: str) -> bool:
    """Whether ``key`` is the key of ``digest`` (compared in constant time)."""
    return hmac.compare_digest(api_key_digest(key), digest)


def write_api_key(path: Path, key: str) -> None:
    """Write ``key`` to ``path`` (mode 0600), replacing any key there, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
