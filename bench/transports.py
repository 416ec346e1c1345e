"""Weight transports between two processes: MB/s beside raw loopback TCP, and publish-to-served.

A sender process (the trainer's side) holds a state dict of float32 tensors totalling each of
``--sizes`` MB (MB = 2**20 bytes here: four large LoRA pairs and six small ones, rank 16,
deterministic values) and a receiver process (an inference replica) fetches it, through:

- ``raw TCP``, the wire's limit: the receiver, already connected, sends one request byte and the
  sender answers with the tensors' bytes (``sendall`` of each tensor's buffer); the receiver
  ``recv_into``s a preallocated bytearray. No framing, no digest, no tensors built.
- ``object_store``: the sender encodes the adapter (``EncodedStream``: safetensors header, views
  of the tensors, BLAKE3) and stores it with ``write_blob`` in the JetStream object store of an
  embedded nats-server (as deployed: file storage, every write synced); the receiver runs
  ``load_weights``: the chunks stream into the tensors, hashed as they land, then the digest.
- ``filesystem``: the sender writes a PEFT directory (``write_weights_dir``) under a temporary
  directory; the receiver reads it through the page cache with ``load_weights`` (``readinto``
  the tensors, hashed as they land).
- ``ucx``: the sender serves an ``EncodedStream`` with ``UcxWeightServer``; the receiver's
  ``UcxWeightClient.fetch`` pulls it over UCX (``UCX_TLS=tcp`` unless set) and verifies it.
- ``collective``: ``CollectiveSender.send`` broadcasts the stream to the group the receiver
  joined (torch.distributed, gloo on CPU, ``GLOO_SOCKET_IFNAME=lo`` unless set) and returns the
  location once it is delivered; the receiver's ``CollectiveReceiver.fetch`` then hands over
  what arrived. This transport pushes, so its time starts when ``send`` is called (encoding
  done) and ends when ``fetch`` returns; it includes one pipe hop from sender to receiver.

Beside them, more references measured in the same rounds: ``raw TCP + blake3``, the same
socket transfer with the receiver hashing what has landed in a second thread (BLAKE3, one
thread, as the transports do) while the rest arrives (the wire's limit for a transfer that is
verified, which every plexrl transport is), and the rates at which the receiver hashes that
many bytes on its own (BLAKE3 one thread, and SHA-256, which publishers announced before), and
``core NATS (nats-py)``: the same bytes as plain core-NATS messages of the server's max_payload
(no JetStream, no digest) from the sender's client to the receiver's, the most any transport
through the Python NATS client (the object store) can reach.

Each transport is measured twice: into fresh tensors (an adapter on a replica), whose first
touch of every page is part of the time (about 110 ms per 500 MB here, as much as raw TCP's
whole transfer of it), and ``in place`` into parameters the receiver already holds, zero-filled
before the clock starts as raw TCP's buffer is (a replica installing full weights). The second
compares the transport with the wire like for like.

MB/s = payload bytes / the receiver's time from being handed the announcement (the request, for
raw TCP) to verified tensors in hand. Per size, the rounds alternate the order of the paths;
the median of ``--repeats`` rounds (default 3, 1 from 500 MB up) is set beside raw TCP measured
in the same rounds. Staging on the sender side (serialise, store, write) is outside that time.
After each transfer, outside its time, the receiver's tensors are checked against the sender's
(key, shape, dtype and CRC-32 of every tensor; for raw TCP, of every tensor's byte range).

End to end, at ``--e2e-size`` MB: ``WeightPublisher.publish`` in the sender (stage, announce) to
``load_weights`` returning in the receiver, which got the WeightsReady from its subscription;
``time.monotonic`` is one clock for every process on the machine.

A transport whose module is missing or that fails to start or to transfer is reported as
"n/a (why)" and the others are still measured.

    .venv/bin/python bench/transports.py [--sizes 1,50,500] [--repeats N] [--e2e-size 50]
        [--transports object_store,filesystem,ucx,collective]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import itertools
import math
import multiprocessing as mp
import os
import resource
import shutil
import socket
import statistics
import tempfile
import threading
import time
import zlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, get_args

import blake3
import torch
from torch import Tensor

from schemas import decode
from schemas.events import LoraSpec, Transport, WeightsReady
from schemas.subjects import weights_object_key, weights_subject
from services.bus import Bus, EmbeddedNats
from services.model.peft_io import peft_adapter_config, write_weights_dir
from services.weights import WeightPublisher, load_weights
from services.weights.blobs import delete_blob, write_blob
from services.weights.stream import EncodedStream, byte_view

MB = 1 << 20
RANK = 16
LARGE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
NUM_SMALL, SMALL_DIM = 6, 64
LORA = LoraSpec(rank=RANK, alpha=32.0, target_modules=[*LARGE_MODULES, "down_proj"])
TRANSPORTS: tuple[Transport, ...] = get_args(Transport)
TARGETS: dict[str, float | None] = {
    "object_store": 0.4,
    "filesystem": None,
    "ucx": 0.7,
    "collective": 0.7,
}
E2E_TARGET_S = 1.0
COMMAND_TIMEOUT = 120.0
"""Seconds a process gives one command before answering that it timed out."""

RAW = "raw TCP"
RAW_HASHED = "raw TCP + blake3"
CORE_NATS = "core NATS (nats-py)"
IN_PLACE = ", in place"
"""Suffix of a path whose receiver installs into parameters it already holds (as a replica
installs full weights); without it the receiver gets fresh tensors, whose first-touch page
faults are part of its time (about 110 ms per 500 MB on this machine)."""
CORE_SUBJECT = "bench.transports.core"
Fingerprint = dict[str, tuple[tuple[int, ...], str, int]]


class TransferError(RuntimeError):
    """A transport failed, timed out or delivered tensors other than those sent."""


# --- the payload ------------------------------------------------------------------------------


def payload_shapes(size_bytes: int) -> dict[str, tuple[int, int]]:
    """PEFT keys and shapes of float32 tensors totalling ``size_bytes`` (to within 512 bytes)."""
    small = {
        f"base_model.model.model.layers.{i}.mlp.down_proj.lora_{ab}.weight": shape
        for i in range(1, NUM_SMALL + 1)
        for ab, shape in (("A", (RANK, SMALL_DIM)), ("B", (SMALL_DIM, RANK)))
    }
    small_bytes = 4 * sum(r * c for r, c in small.values())
    dim = (size_bytes - small_bytes) // (len(LARGE_MODULES) * 2 * RANK * 4)
    if dim < 1:
        raise ValueError(f"a payload needs at least {small_bytes + 512} bytes, not {size_bytes}")
    large = {
        f"base_model.model.model.layers.0.self_attn.{name}.lora_{ab}.weight": shape
        for name in LARGE_MODULES
        for ab, shape in (("A", (RANK, dim)), ("B", (dim, RANK)))
    }
    return large | small


def make_payload(size_bytes: int) -> dict[str, Tensor]:
    state = {}
    for seed, (key, shape) in enumerate(payload_shapes(size_bytes).items()):
        state[key] = torch.rand(shape, generator=torch.Generator().manual_seed(seed)).sub_(0.5)
    return state


def fingerprint(state: dict[str, Tensor]) -> Fingerprint:
    return {
        key: (tuple(t.shape), str(t.dtype), zlib.crc32(t.detach().cpu().contiguous().numpy().data))
        for key, t in state.items()
    }


def check_same(expected: Fingerprint, got: Fingerprint) -> None:
    if got == expected:
        return
    if got.keys() != expected.keys():
        raise TransferError(
            f"received keys differ: missing {sorted(expected.keys() - got.keys())[:3]}, "
            f"unexpected {sorted(got.keys() - expected.keys())[:3]}"
        )
    bad = [key for key in expected if got[key] != expected[key]]
    raise TransferError(f"{len(bad)} received tensors differ from those sent, e.g. {bad[0]}")


def _event(
    run_id: str, step: int, transport: Transport, location: str, digest: str, size: int
) -> WeightsReady:
    return WeightsReady(
        run_id=run_id,
        idx=0,
        step=step,
        transport=transport,
        location=location,
        digest=digest,
        size_bytes=size,
        lora=LORA,
    )


def _write_dir(path: Path, stream: EncodedStream) -> None:
    config = peft_adapter_config(LORA.rank, LORA.alpha, LORA.target_modules)
    write_weights_dir(path, stream.segments(), config)


# --- the two processes ------------------------------------------------------------------------


class _Side:
    """One process's bus connection and command loop: ``(name, args)`` in, one reply out."""

    role = ""

    def __init__(self, conn: Connection, url: str, workdir: Path) -> None:
        self.conn, self.url, self.workdir = conn, url, workdir
        # The ucx and collective endpoints, built by ``prepare`` once per process.
        self.endpoints: dict[str, Any] = {}

    async def serve(self) -> None:
        # Only the sender provisions, so the two never race to create the same stream.
        self.bus = await Bus.connect(
            self.url, f"bench-{self.role}", provision_streams=self.role == "sender"
        )
        self.conn.send(("ok", await self.start()))
        while True:
            name, args = await asyncio.to_thread(self.conn.recv)
            if name == "stop":
                break
            try:
                reply = ("ok", await asyncio.wait_for(getattr(self, name)(*args), COMMAND_TIMEOUT))
            except TimeoutError:
                reply = ("error", f"{name} timed out after {COMMAND_TIMEOUT:g}s")
            except Exception as exc:  # the one boundary: report it and keep serving
                reply = ("error", f"{type(exc).__name__}: {exc}")
            self.conn.send(reply)
        for endpoint in self.endpoints.values():
            await endpoint.close()
        await self.bus.close()
        self.conn.send(("ok", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))

    async def start(self) -> Any:
        return None


class _Sender(_Side):
    role = "sender"

    async def start(self) -> int:
        self.state: dict[str, Tensor] = {}
        self.publishers: dict[str, WeightPublisher] = {}
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(COMMAND_TIMEOUT)
        # Subscribed once, long before any round, so no "go" can come before it is heard.
        self.go: asyncio.Queue[None] = asyncio.Queue()

        async def on_go(_msg: Any) -> None:
            self.go.put_nowait(None)

        await self.bus.nc.subscribe(f"{CORE_SUBJECT}.go", cb=on_go)
        return int(self.listener.getsockname()[1])

    async def payload(self, size_bytes: int) -> Fingerprint:
        self.state = {}  # the previous payload goes before the next is built
        self.state = await asyncio.to_thread(make_payload, size_bytes)
        return fingerprint(self.state)

    async def prepare(self, transport: str) -> None:
        if transport == "ucx":
            ucx = importlib.import_module("services.weights.ucx")
            self.endpoints[transport] = ucx.UcxWeightServer("127.0.0.1", 0)
        elif transport == "collective":
            collective = importlib.import_module("services.weights.collective")
            self.endpoints[transport] = collective.CollectiveSender(self.bus, "127.0.0.1", 0)
        else:
            return
        await self.endpoints[transport].start()

    async def raw_serve(self) -> None:
        await asyncio.to_thread(self._raw_serve)

    def _raw_serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(1)
            for tensor in self.state.values():
                conn.sendall(tensor.numpy().data)

    async def nats_serve(self) -> None:
        """Publish the payload's bytes as plain core-NATS messages of up to the server's
        max_payload, as soon as the receiver says go: the Python client's own ceiling."""
        await self.go.get()
        nc = self.bus.nc
        piece = nc.max_payload or MB
        for tensor in self.state.values():
            view = byte_view(tensor)
            for start in range(0, len(view), piece):
                await nc.publish(f"{CORE_SUBJECT}.data", view[start : start + piece].tobytes())
        await nc.flush()

    async def stage(
        self, transport: Transport, step: int, run_id: str
    ) -> tuple[WeightsReady, float | None]:
        """Put the payload where the receiver will fetch it from: the announcement to send, and
        for a transport that pushes (collective) when the push began."""
        # Every transport sends the tensors' own memory: encoding is the header and the hash.
        stream = await asyncio.to_thread(EncodedStream.from_state_dict, self.state)
        match transport:
            case "object_store":
                key = weights_object_key(run_id, step)
                await write_blob(self.bus, key, stream.segments(), stream.digest)
                return _event(run_id, step, transport, key, stream.digest, stream.size), None
            case "filesystem":
                path = self.workdir / "fs" / run_id / f"step_{step}"
                await asyncio.to_thread(_write_dir, path, stream)
                location = str(path)
                return _event(run_id, step, transport, location, stream.digest, stream.size), None
        pushed = time.monotonic()
        # ucx holds the stream until asked; collective broadcasts it before returning.
        location = await self.endpoints[transport].send(run_id, step, stream)
        event = _event(run_id, step, transport, location, stream.digest, stream.size)
        return event, pushed if transport == "collective" else None

    async def unstage(self, event: WeightsReady) -> None:
        match event.transport:
            case "object_store":
                await delete_blob(self.bus, event.location)
            case "filesystem":
                await asyncio.to_thread(shutil.rmtree, event.location)
            case direct:
                await self.endpoints[direct].forget(event.run_id, [event.step])

    async def publish(self, transport: Transport, run_id: str, step: int) -> tuple[float, float]:
        publisher = self.publishers.get(transport)
        if publisher is None:
            direct = {"sender": self.endpoints[transport]} if transport in self.endpoints else {}
            publisher = WeightPublisher(self.bus, self.workdir / "weights", transport, **direct)
            self.publishers[transport] = publisher
        start = time.monotonic()
        await publisher.publish(run_id, 0, step, self.state, LORA)
        return start, time.monotonic()


class _Receiver(_Side):
    role = "receiver"

    async def start(self) -> None:
        self.done: asyncio.Future[tuple[float, float, Fingerprint]] | None = None
        self.sub: Any = None
        self.destination: dict[str, Tensor] | None = None

    async def prepare(self, transport: str) -> None:
        if transport == "ucx":
            ucx = importlib.import_module("services.weights.ucx")
            self.endpoints[transport] = ucx.UcxWeightClient()
        elif transport == "collective":
            collective = importlib.import_module("services.weights.collective")
            receiver = collective.CollectiveReceiver(self.bus, "bench-receiver")
            self.endpoints[transport] = receiver
            await receiver.start()
            await receiver.joined()

    async def raw_fetch(
        self, port: int, layout: list[tuple[str, tuple[int, ...]]], hashed: bool = False
    ) -> Any:
        # Allocated (and zero-filled, so its pages exist) before the clock starts; dropped
        # afterwards, so that it adds nothing to the peak memory of the other transports.
        buffer = bytearray(4 * sum(math.prod(shape) for _, shape in layout))
        seconds = await asyncio.to_thread(_raw_fetch, port, buffer, hashed)
        return seconds, _buffer_fingerprint(buffer, layout)

    async def nats_fetch(self, layout: list[tuple[str, tuple[int, ...]]]) -> Any:
        buffer = bytearray(4 * sum(math.prod(shape) for _, shape in layout))
        view, received = memoryview(buffer), 0
        done = asyncio.get_running_loop().create_future()

        async def on_data(msg: Any) -> None:
            nonlocal received
            view[received : received + len(msg.data)] = msg.data
            received += len(msg.data)
            if received >= len(buffer) and not done.done():
                done.set_result(None)

        sub = await self.bus.nc.subscribe(
            f"{CORE_SUBJECT}.data", cb=on_data, pending_bytes_limit=-1, pending_msgs_limit=-1
        )
        await self.bus.nc.flush()
        start = time.monotonic()
        await self.bus.nc.publish(f"{CORE_SUBJECT}.go", b"")
        await done
        seconds = time.monotonic() - start
        await sub.unsubscribe()
        view.release()
        return seconds, _buffer_fingerprint(buffer, layout)

    async def hash_rate(self, nbytes: int, algorithm: str) -> float:
        """Seconds to hash ``nbytes`` on one core (the median of three)."""
        data = bytearray(nbytes)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            # on the loop itself: nothing else is waiting on it now
            if algorithm == "sha256":
                hashlib.sha256(data)
            else:
                blake3.blake3(data, max_threads=1)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    async def hold(self, layout: list[tuple[str, tuple[int, ...]]], run_id: str) -> None:
        """Parameters to install into, as a replica holds them: zero-filled (so their pages
        exist, like raw TCP's buffer) before the clock starts. A collective replica lands the
        run's pushes in them from then on, so each size has a run id of its own."""
        self.destination = {key: torch.zeros(shape) for key, shape in layout}
        if (receiver := self.endpoints.get("collective")) is not None:
            receiver.receive_into(run_id, self.destination)

    async def release(self) -> None:
        self.destination = None

    async def fetch(self, event: WeightsReady, pushed: float | None) -> tuple[float, Fingerprint]:
        """Seconds from the announcement (or from the start of a push) to verified tensors."""
        start = time.monotonic() if pushed is None else pushed
        state = await self._load(event)
        seconds = time.monotonic() - start
        return seconds, await asyncio.to_thread(fingerprint, state)

    async def _load(self, event: WeightsReady) -> dict[str, Tensor]:
        # The inference path for every transport: a direct one goes to its fetcher.
        return await load_weights(
            self.bus, event, self.workdir, fetchers=self.endpoints, destination=self.destination
        )

    async def listen(self, run_id: str) -> None:
        """Subscribe to ``run_id``'s WeightsReady; load the first one as soon as it arrives."""
        done = self.done = asyncio.get_running_loop().create_future()

        async def on_message(msg: Any) -> None:
            if done.done():
                return
            announced = time.monotonic()
            try:
                event: WeightsReady = decode(
                    msg.data, WeightsReady, (msg.headers or {}).get("Content-Type")
                )
                state = await self._load(event)
                loaded = time.monotonic()
                done.set_result((announced, loaded, await asyncio.to_thread(fingerprint, state)))
            except Exception as exc:  # handed to ``collect``, which reports it
                done.set_exception(exc)

        self.sub = await self.bus.nc.subscribe(weights_subject(run_id), cb=on_message)
        await self.bus.nc.flush()  # the server knows the subscription before anything is published

    async def collect(self) -> tuple[float, float, Fingerprint]:
        assert self.done is not None
        try:
            return await self.done
        finally:
            await self.unlisten()

    async def unlisten(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()
        self.sub = self.done = None


def _buffer_fingerprint(buffer: bytearray, layout: list[tuple[str, tuple[int, ...]]]) -> Any:
    """What ``fingerprint`` gives for tensors, from float32 tensors laid end to end in ``buffer``."""
    got, offset = {}, 0
    with memoryview(buffer) as view:
        for key, shape in layout:
            end = offset + 4 * math.prod(shape)
            got[key] = (shape, str(torch.float32), zlib.crc32(view[offset:end]))
            offset = end
    return got


def _raw_fetch(port: int, buffer: bytearray, hashed: bool = False) -> float:
    """Seconds to receive ``buffer``'s worth; ``hashed``: and to BLAKE3 it, in a thread that
    hashes what has landed while the rest arrives (what the direct transports do)."""
    view, received = memoryview(buffer), 0
    progress = threading.Condition()
    digest: list[str] = []

    def hash_as_landed() -> None:
        hasher, done = blake3.blake3(max_threads=1), 0
        while done < len(buffer):
            with progress:
                while received <= done:
                    progress.wait()
                mark = received
            hasher.update(view[done:mark])
            done = mark
        digest.append(hasher.hexdigest())

    hasher = threading.Thread(target=hash_as_landed, daemon=True) if hashed else None
    with socket.create_connection(("127.0.0.1", port)) as conn:
        start = time.monotonic()
        if hasher is not None:
            hasher.start()
        conn.sendall(b"g")
        while received < len(buffer):
            n = conn.recv_into(view[received : received + (8 << 20)])
            if not n:
                raise TransferError(f"connection closed after {received} of {len(buffer)} bytes")
            with progress:
                received += n
                progress.notify()
        if hasher is not None:
            hasher.join()
        return time.monotonic() - start


def _child_main(role: str, conn: Connection, url: str, workdir: str) -> None:
    side = _Sender if role == "sender" else _Receiver
    asyncio.run(side(conn, url, Path(workdir)).serve())


# --- the parent: drives both, measures nothing itself -------------------------------------------


class _Child:
    def __init__(self, role: str, url: str, workdir: Path) -> None:
        ctx = mp.get_context("spawn")
        self.role = role
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child_main, args=(role, theirs, url, str(workdir)), daemon=True
        )
        self.proc.start()
        theirs.close()

    def send(self, name: str, *args: Any) -> None:
        self.conn.send((name, args))

    def recv(self) -> Any:
        if not self.conn.poll(COMMAND_TIMEOUT + 60):
            raise RuntimeError(f"the {self.role} process stopped answering")
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(
                f"the {self.role} process died (exit {self.proc.exitcode})"
            ) from None
        if status == "error":
            raise TransferError(value)
        return value

    def call(self, name: str, *args: Any) -> Any:
        self.send(name, *args)
        return self.recv()

    def stop(self) -> float:
        self.send("stop")
        peak = self.recv()
        self.proc.join(10)
        return float(peak)


def both(sender: _Child, receiver: _Child, command: tuple[Any, ...], other: tuple[Any, ...]) -> Any:
    """Send each its command, wait for both; the receiver's answer, or the first error."""
    sender.send(*command)
    receiver.send(*other)
    errors, answers = [], []
    for child in (receiver, sender):
        try:
            answers.append(child.recv())
        except TransferError as exc:
            errors.append(f"{child.role}: {exc}")
    if errors:
        raise TransferError("; ".join(errors))
    return answers[0]


_steps = itertools.count(1)
"""Every staged transfer gets a step of its own, so no transport ever sees one twice."""


def transfer(
    sender: _Child, receiver: _Child, path: str, layout: list[Any], port: int
) -> tuple[float, Fingerprint]:
    if path in (RAW, RAW_HASHED):
        fetch = ("raw_fetch", port, layout, path == RAW_HASHED)
        return tuple(both(sender, receiver, ("raw_serve",), fetch))  # type: ignore[return-value]
    if path == CORE_NATS:
        return tuple(both(sender, receiver, ("nats_serve",), ("nats_fetch", layout)))  # type: ignore[return-value]
    transport, in_place = path.removesuffix(IN_PLACE), path.endswith(IN_PLACE)
    run_id = f"run_bench_{transport}"
    if in_place:
        run_id += f"_in_place_{sum(math.prod(shape) for _, shape in layout)}"
        receiver.call("hold", layout, run_id)
    event, pushed = sender.call("stage", transport, next(_steps), run_id)
    try:
        return tuple(receiver.call("fetch", event, pushed))  # type: ignore[return-value]
    finally:
        sender.call("unstage", event)
        if in_place:
            receiver.call("release")


def throughput(
    sender: _Child,
    receiver: _Child,
    port: int,
    size_mb: float,
    repeats: int,
    transports: list[str],
    unavailable: dict[str, str],
) -> list[str]:
    expected = sender.call("payload", int(size_mb * MB))
    layout = [(key, shape) for key, (shape, _, _) in expected.items()]
    nbytes = 4 * sum(math.prod(shape) for _, shape in layout)
    available = [t for t in transports if t not in unavailable]
    paths = [RAW, RAW_HASHED, CORE_NATS, *available, *(t + IN_PLACE for t in available)]
    seconds: dict[str, list[float]] = {p: [] for p in paths}
    failed: dict[str, str] = {}
    for r in range(repeats):
        # rotate the order so drift on a noisy machine hits every path alike
        for path in paths[r % len(paths) :] + paths[: r % len(paths)]:
            if path in failed:
                continue
            try:
                took, got = transfer(sender, receiver, path, layout, port)
                check_same(expected, got)
            except TransferError as exc:
                failed[path] = str(exc)
                continue
            seconds[path].append(took)
    if RAW in failed:
        raise RuntimeError(f"raw TCP failed at {size_mb:g} MB: {failed[RAW]}")
    raw = nbytes / MB / statistics.median(seconds[RAW])
    verified = nbytes / MB / statistics.median(seconds[RAW_HASHED])
    b3 = nbytes / MB / receiver.call("hash_rate", nbytes, "blake3")
    sha = nbytes / MB / receiver.call("hash_rate", nbytes, "sha256")
    rows = [
        f"| {size_mb:g} MB | {RAW} (loopback) | {raw:,.0f} | 1.00x | {raw / verified:.2f}x "
        "| baseline |",
        f"| {size_mb:g} MB | {RAW_HASHED} as it lands | {verified:,.0f} | {verified / raw:.2f}x "
        "| 1.00x | baseline of a verified transfer |",
        f"| {size_mb:g} MB | (blake3 alone, one core: not a transport) | {b3:,.0f} "
        f"| {b3 / raw:.2f}x | {b3 / verified:.2f}x | reference |",
        f"| {size_mb:g} MB | (sha256 alone, one core: not a transport) | {sha:,.0f} "
        f"| {sha / raw:.2f}x | {sha / verified:.2f}x | reference (older publishers) |",
    ]
    if CORE_NATS in failed:
        rows.append(f"| {size_mb:g} MB | {CORE_NATS} | n/a ({failed[CORE_NATS]}) | — | — | |")
    else:
        core = nbytes / MB / statistics.median(seconds[CORE_NATS])
        rows.append(
            f"| {size_mb:g} MB | {CORE_NATS}, max_payload messages, no JetStream | {core:,.0f} "
            f"| {core / raw:.2f}x | {core / verified:.2f}x | reference: the Python client's ceiling |"
        )
    for path in [*transports, *(t + IN_PLACE for t in transports)]:
        transport = path.removesuffix(IN_PLACE)
        target = TARGETS[transport]
        goal = f"≥ {target:.1f}x" if target else "—"
        why = unavailable.get(transport) or failed.get(path)
        label = f"{transport} into fresh tensors" if path == transport else path
        if why:
            rows.append(f"| {size_mb:g} MB | {label} | n/a ({why}) | — | — | {goal} |")
            continue
        rate = nbytes / MB / statistics.median(seconds[path])
        verdict = "" if target is None else (" met" if rate / raw >= target else " MISSED")
        rows.append(
            f"| {size_mb:g} MB | {label} | {rate:,.0f} | {rate / raw:.2f}x "
            f"| {rate / verified:.2f}x | {goal}{verdict} |"
        )
    return rows


def end_to_end(
    sender: _Child,
    receiver: _Child,
    size_mb: float,
    repeats: int,
    transports: list[str],
    unavailable: dict[str, str],
) -> list[str]:
    expected = sender.call("payload", int(size_mb * MB))
    rows = []
    for transport in transports:
        samples: list[tuple[float, float, float]] = []
        why = unavailable.get(transport)
        for step in range(1, repeats + 1):
            if why:
                break
            run_id = f"run_e2e_{transport}"
            try:
                receiver.call("listen", run_id)
                try:
                    start, published = sender.call("publish", transport, run_id, step)
                except TransferError:
                    receiver.call("unlisten")
                    raise
                announced, loaded, got = receiver.call("collect")
                check_same(expected, got)
            except TransferError as exc:
                why = str(exc)
                break
            samples.append((published - start, loaded - announced, loaded - start))
        if why:
            rows.append(
                f"| {size_mb:g} MB | {transport} | n/a ({why}) | | | < {E2E_TARGET_S:g} s |"
            )
            continue
        publish_s, load_s, total_s = (statistics.median(col) for col in zip(*samples, strict=True))
        verdict = "met" if total_s < E2E_TARGET_S else "MISSED"
        rows.append(
            f"| {size_mb:g} MB | {transport} | {publish_s * 1e3:,.0f} ms | {load_s * 1e3:,.0f} ms "
            f"| {total_s * 1e3:,.0f} ms | < {E2E_TARGET_S:g} s {verdict} |"
        )
    return rows


def prepare(sender: _Child, receiver: _Child, port: int, transports: list[str]) -> dict[str, str]:
    """Start each transport's endpoints in both processes and move 1 MB through each, untimed,
    so that no measured round pays for a first connection; why each one that failed is n/a."""
    unavailable = {}
    expected = sender.call("payload", MB)
    layout = [(key, shape) for key, (shape, _, _) in expected.items()]
    for path in (RAW, *transports):
        try:
            if path != RAW:
                both(sender, receiver, ("prepare", path), ("prepare", path))
            _, got = transfer(sender, receiver, path, layout, port)
            check_same(expected, got)
        except TransferError as exc:
            if path == RAW:
                raise RuntimeError(f"raw TCP, the baseline, failed: {exc}") from exc
            unavailable[path] = str(exc)
    return unavailable


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1,50,500", help="payload sizes in MB (2**20 bytes)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument(
        "--repeats", type=int, default=0, help="rounds per size (default 3, and 1 from 500 MB)"
    )
    parser.add_argument(
        "--e2e-size", type=float, default=50.0, help="MB for publish-to-served (0: skip)"
    )
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if unknown := set(transports) - set(TRANSPORTS):
        parser.error(f"unknown transports {sorted(unknown)}: choose from {', '.join(TRANSPORTS)}")
    for name, value in (
        ("UCX_TLS", "tcp"),
        ("UCX_WARN_UNUSED_ENV_VARS", "n"),
        ("GLOO_SOCKET_IFNAME", "lo"),
    ):
        os.environ.setdefault(name, value)  # inherited by both processes
    with (
        tempfile.TemporaryDirectory(prefix="plexrl-bench-transports-") as tmp,
        EmbeddedNats(store_dir=Path(tmp) / "nats") as server,
    ):
        sender = _Child("sender", server.url, Path(tmp))
        port = sender.recv()
        receiver = _Child("receiver", server.url, Path(tmp))
        receiver.recv()
        unavailable = prepare(sender, receiver, port, transports)
        rows = []
        for size in sizes:
            repeats = args.repeats or (1 if size >= 500 else 3)
            rows += throughput(sender, receiver, port, size, repeats, transports, unavailable)
        e2e_rows = []
        if args.e2e_size:
            repeats = args.repeats or 3
            e2e_rows = end_to_end(sender, receiver, args.e2e_size, repeats, transports, unavailable)
        # The receiver first: its endpoints close before the sender's listeners go.
        receiver_peak = receiver.stop()
        peaks = sender.stop(), receiver_peak
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, UCX_TLS={os.environ['UCX_TLS']}, "
        f"MB = 2**20 bytes of float32 tensors; median of the rounds\n"
    )
    print("| size | transport | MB/s | vs raw TCP | vs raw TCP + blake3 | target (vs raw TCP) |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    print("\n".join(rows))
    if e2e_rows:
        print(
            f"\n### WeightPublisher.publish -> load_weights returned (median of {repeats})\n\n"
            "| size | transport | publish() | announced -> loaded | publish() start -> loaded "
            "| target |\n| --- | --- | ---: | ---: | ---: | --- |"
        )
        print("\n".join(e2e_rows))
    print(f"\npeak RSS: sender {peaks[0]:,.0f} MB, receiver {peaks[1]:,.0f} MB")


if __name__ == "__main__":
    main()
