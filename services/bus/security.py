"""How a client proves who it is to NATS: credentials (an nkey seed or a ``.creds`` file) and
TLS, from the process settings, each checked before connecting so that a wrong file is a clear
error rather than a refused connection."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import nkeys

from services.bus.errors import BusUnavailable
from services.config import ProcessSettings


def credentials(path: Path) -> dict[str, Any]:
    """``nats.connect`` arguments for an nkey seed file or a ``.creds`` file, checked first so a
    wrong path or file is a clear error rather than a refused connection."""
    where = f"NATS credentials {path} (PLEXRL_NATS_CREDS)"
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        raise BusUnavailable(f"{where}: no such file") from None
    except OSError as exc:
        raise BusUnavailable(f"{where}: cannot be read: {exc}") from None
    if "BEGIN NATS USER JWT" in text:
        return {"user_credentials": str(path)}
    try:
        prefix, _ = nkeys.decode_seed(text.strip().encode())
    except (nkeys.NkeysError, ValueError):
        prefix = None
    if prefix != nkeys.PREFIX_BYTE_USER:
        raise BusUnavailable(
            f"{where}: neither a user nkey seed (SU..., as `plexrl tenants add` writes) nor a "
            ".creds file"
        )
    return {"nkeys_seed": str(path)}


def tls_context(settings: ProcessSettings) -> ssl.SSLContext | None:
    """The client's TLS context from PLEXRL_TLS_CA / _CERT / _KEY; None when none is set."""
    ca, cert, key = settings.tls_ca, settings.tls_cert, settings.tls_key
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise BusUnavailable("TLS: set both PLEXRL_TLS_CERT and PLEXRL_TLS_KEY, or neither")
    try:
        context = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
        if cert is not None and key is not None:
            context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        files = ", ".join(str(p) for p in (ca, cert, key) if p is not None)
        raise BusUnavailable(f"TLS: cannot use {files}: {exc}") from None
    return context
