"""Download URLs of saved checkpoints: signed by this gateway, served from the trainer in chunks.

A checkpoint's files (its PEFT adapter: ``adapter_config.json``, ``adapter_model.safetensors``)
are fetched by clients that send no API key (``tinker checkpoint download`` opens the URLs
with ``urllib``), so each URL carries what it grants, signed: the tenant, the run, the
checkpoint, one file or the whole adapter as a tar archive, and when it stops working
(``download_ttl_s``). The signature is an HMAC-SHA256 with a key made when the gateway process
starts, so nobody can forge a URL or widen one, and a restarted gateway's old URLs stop working
(the client asks for new ones).

The bytes come from the trainer's ``checkpoints`` command (``read``), chunk by chunk, and are
streamed as they arrive; the archive is a plain (uncompressed) tar written the same way, its
headers first, so nothing is held in memory and ``peft.PeftModel.from_pretrained`` loads what
it unpacks to.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from schemas.training import CHUNK_MAX, CheckpointFile

BLOCK = 512
"""a tar block"""
ARCHIVE = "adapter.tar"
"""the file name of a checkpoint's archive"""


class BadToken(ValueError):
    """A download URL that was not signed here, was changed, or has expired."""


@dataclass(frozen=True)
class Grant:
    """What one download URL grants: ``file`` of the checkpoint, or the archive (``file`` "")."""

    tenant: str
    run_id: str
    name: str
    file: str
    expires: int


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(key: bytes, grant: Grant) -> str:
    """The token of ``grant``: its fields and their signature."""
    payload = json.dumps(
        [grant.tenant, grant.run_id, grant.name, grant.file, grant.expires],
        separators=(",", ":"),
    ).encode()
    mac = hmac.new(key, payload, hashlib.sha256).digest()
    return f"{_b64(payload)}.{_b64(mac)}"


def verify(key: bytes, token: str, now: float | None = None) -> Grant:
    """The grant of a token this key signed and that has not expired; :class:`BadToken` else."""
    body, _, mac = token.partition(".")
    try:
        payload, given = _unb64(body), _unb64(mac)
    except (ValueError, TypeError):
        raise BadToken("the download URL is malformed") from None
    if not hmac.compare_digest(hmac.new(key, payload, hashlib.sha256).digest(), given):
        raise BadToken("the download URL was not signed by this gateway (or it restarted since)")
    tenant, run_id, name, file, expires = json.loads(payload)
    grant = Grant(str(tenant), str(run_id), str(name), str(file), int(expires))
    if grant.expires <= (time.time() if now is None else now):
        raise BadToken("the download URL has expired; ask for a new one")
    return grant


ReadChunk = Callable[[str, int, int], Awaitable[bytes]]
"""``read(file, offset, length)``: bytes of one of the checkpoint's files"""


async def file_bytes(read: ReadChunk, file: CheckpointFile) -> AsyncIterator[bytes]:
    """The bytes of ``file``, chunk by chunk; an error if it changed size meanwhile."""
    offset = 0
    while offset < file.size_bytes:
        chunk = await read(file.path, offset, min(CHUNK_MAX, file.size_bytes - offset))
        if not chunk:
            raise OSError(f"{file.path} ended at {offset} of {file.size_bytes} bytes")
        offset += len(chunk)
        yield chunk


def archive_size(files: list[CheckpointFile]) -> int:
    """The length of :func:`archive_bytes` of ``files``."""
    return sum(BLOCK + -(-f.size_bytes // BLOCK) * BLOCK for f in files) + 2 * BLOCK


async def archive_bytes(
    read: ReadChunk, files: list[CheckpointFile], mtime: float
) -> AsyncIterator[bytes]:
    """An uncompressed tar of ``files``, written as their chunks arrive."""
    for f in files:
        info = tarfile.TarInfo(f.path)
        info.size, info.mode, info.mtime = f.size_bytes, 0o644, int(mtime)
        yield info.tobuf(format=tarfile.USTAR_FORMAT)
        async for chunk in file_bytes(read, f):
            yield chunk
        yield b"\0" * (-f.size_bytes % BLOCK)
    yield b"\0" * (2 * BLOCK)
