"""The ``filesystem`` weight transport: each version is a directory on a shared filesystem.

The trainer writes ``{output_dir}/<run_id>/broadcast/step_<n>/`` (the location) atomically from
the tensors' own memory: a PEFT directory for an adapter (``adapter_model.safetensors`` and
``adapter_config.json``, which vLLM and PEFT load as it is), or ``model.safetensors``
(:data:`~services.model.peft_io.FULL_WEIGHTS_FILE`) for full weights. A replica reads the header,
then the data straight into the tensors with ``readinto``, hashed while it lands. A location
that does not resolve inside the replica's ``output_dir`` is refused, so an event cannot make a
replica read an arbitrary file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
from collections.abc import Collection, Mapping
from io import FileIO
from pathlib import Path
from typing import Any

from torch import Tensor

from schemas.events import WeightsReady
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus
from services.model.peft_io import ADAPTER_WEIGHTS, FULL_WEIGHTS_FILE, write_weights_dir
from services.weights.errors import WeightsError
from services.weights.stream import CHUNK_BYTES, EncodedStream, StreamDecoder, split
from services.weights.transport import SenderOptions, forget_each

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")


class FilesystemSender:
    """The trainer's end: one directory per version under ``output_dir``."""

    name = "filesystem"
    in_memory = False

    def __init__(self, output_dir: Path) -> None:
        # Absolute, because the location goes to other processes with other working directories.
        self.output_dir = Path(output_dir).absolute()

    async def start(self) -> None:
        pass

    async def send(
        self,
        run_id: str,
        step: int,
        stream: EncodedStream,
        adapter_config: Any = None,
        *,
        tenant: str = DEFAULT_TENANT,
    ) -> str:
        path = self._root(run_id) / f"step_{step}"
        # Written from the very views the digest was computed over.
        await asyncio.to_thread(write_weights_dir, path, stream.segments(), adapter_config)
        return str(path)

    async def stored(self, run_id: str, *, tenant: str = DEFAULT_TENANT) -> set[int]:
        root = self._root(run_id)
        if not root.is_dir():
            return set()
        return {
            int(m.group(1))
            for entry in root.iterdir()
            if entry.is_dir() and (m := _STEP_DIR.match(entry.name))
        }

    async def forget(
        self, run_id: str, steps: Collection[int], *, tenant: str = DEFAULT_TENANT
    ) -> set[int]:
        return await forget_each(
            run_id,
            steps,
            lambda step: asyncio.to_thread(_remove_dir, self._root(run_id) / f"step_{step}"),
            (OSError,),
        )

    async def close(self) -> None:
        pass

    def _root(self, run_id: str) -> Path:
        return self.output_dir / run_id / "broadcast"


class FilesystemFetcher:
    """A replica's end: the announced file read into a decoder, confined to ``output_dir``."""

    def __init__(self, output_dir: Path | None = None) -> None:
        self.output_dir = output_dir

    async def fetch(
        self,
        event: WeightsReady,
        destination: Mapping[str, Tensor] | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
    ) -> dict[str, Tensor]:
        where = f"weights for {event.run_id} step {event.step}"
        decoder = StreamDecoder(where, event.size_bytes, event.digest, destination)
        await asyncio.to_thread(_read_file_into, event, self.output_dir, decoder)
        # Off the event loop: the rest of the digest may still be hashing.
        return await asyncio.to_thread(decoder.finish)

    async def close(self) -> None:
        pass


def _read_file_into(event: WeightsReady, output_dir: Path | None, decoder: StreamDecoder) -> None:
    """The broadcast file's header into ``decoder``, then its data straight into the targets."""
    where = decoder.where
    path = _broadcast_path(where, event, output_dir)
    try:
        with path.open("rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            if size != event.size_bytes:
                raise WeightsError(
                    f"{where}: size mismatch: announced {event.size_bytes} bytes but {path} "
                    f"holds {size} (truncated, or overwritten by another step)"
                )
            prefix = _read_exactly(file, 8, where, path)
            length = StreamDecoder.header_length(prefix, event.size_bytes, where)
            decoder.feed_header(prefix + _read_exactly(file, length, where, path))
            done = 0
            for piece in split(decoder.targets(), CHUNK_BYTES):
                while len(piece):
                    got = file.readinto(piece)
                    if not got:
                        raise WeightsError(
                            f"{where}: {path} ended after {8 + length + done} of its "
                            f"{event.size_bytes} bytes (truncated while read)",
                            touched=decoder.touched,
                        )
                    piece = piece[got:]
                    done += got
                # The bytes in place so far are hashed on another thread while more are read.
                decoder.landed(done)
    except OSError as exc:
        decoder.abandon()
        raise WeightsError(
            f"{where}: cannot read {path} ({type(exc).__name__}: {exc.strerror or exc}); "
            "the directory may have been garbage-collected after newer steps were published",
            touched=decoder.touched,
        ) from exc
    except BaseException:
        decoder.abandon()
        raise


def _read_exactly(file: FileIO, count: int, where: str, path: Path) -> bytes:
    data = file.read(count)
    if len(data) != count:
        raise WeightsError(f"{where}: {path} ended inside its header (truncated while read)")
    return data


def _broadcast_path(where: str, event: WeightsReady, output_dir: Path | None) -> Path:
    """The safetensors file of a broadcast directory, refused when it is outside ``output_dir``."""
    name = FULL_WEIGHTS_FILE if event.is_full else ADAPTER_WEIGHTS
    path = Path(event.location) / name
    if output_dir is not None:
        root = Path(output_dir).resolve()
        # Resolving the file, not just the directory, also catches a symlink leading out.
        if not path.resolve().is_relative_to(root):
            raise WeightsError(
                f"{where}: location {event.location!r} is outside the output directory "
                f"{str(root)!r}; refusing to read it"
            )
    return path


def _remove_dir(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:  # already gone is what was wanted
        pass


def sender(bus: Bus, output_dir: Path, keep_last: int, options: SenderOptions) -> FilesystemSender:
    return FilesystemSender(output_dir)


def fetcher(bus: Bus, output_dir: Path | None) -> FilesystemFetcher:
    return FilesystemFetcher(output_dir)
