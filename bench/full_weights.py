"""Full-weight mode: what installing a whole model costs a replica's memory, per transport.

A sender process (the trainer's side) publishes a Llama-shaped float32 state dict of ``--size``
MB (MB = 2**20 bytes) with ``WeightPublisher.publish(..., kind="full")``; for each transport
and each way of installing it, a fresh receiver process (an inference replica) first allocates
and touches parameters of the same shapes, notes its peak resident size, installs the announced
version, checks every tensor against the sender's CRC-32s, and reports how far the peak rose
during the install:

- ``in place``: ``load_weights(..., destination=parameters)``, as replicas install full weights
  (the collective receiver registers the parameters before the broadcast, as a replica does
  after its first version);
- ``fresh tensors, then copied`` (the baseline, measured in the same run): ``load_weights``
  without a destination, then ``copy_`` into the parameters, which is what installing through a
  decoded state dict costs.

The ratio is the rise in place over the rise of the baseline; the issue's target is that the
transports move full weights without doubling peak memory, i.e. a rise well below one model.

    .venv/bin/python bench/full_weights.py [--size 256] [--transports object_store,...]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import tempfile
import zlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, get_args

import msgspec
import torch
from torch import Tensor

from schemas.events import LoraSpec, Transport, WeightsReady
from services.bus import Bus, EmbeddedNats
from services.weights import WeightPublisher, load_weights

MB = 1 << 20
LAYER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA = LoraSpec(rank=8, alpha=16.0, target_modules=list(LAYER_MODULES))
TRANSPORTS: tuple[Transport, ...] = get_args(Transport)
RUN_ID = "run_bench_full"
TIMEOUT = 300.0


def shapes(size_bytes: int) -> dict[str, tuple[int, int]]:
    """Hugging Face names and shapes of 8 MiB float32 matrices totalling about ``size_bytes``."""
    dim = 1448  # 1448 * 1448 * 4 bytes = 8 MiB
    count = max(1, round(size_bytes / (dim * dim * 4)))
    names = ["model.embed_tokens.weight"] + [
        f"model.layers.{i // len(LAYER_MODULES)}.self_attn.{LAYER_MODULES[i % 4]}.weight"
        for i in range(count - 1)
    ]
    return {name: (dim, dim) for name in names}


def crcs(state: dict[str, Tensor]) -> dict[str, int]:
    return {k: zlib.crc32(t.contiguous().numpy().data) for k, t in state.items()}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- the sender -----------------------------------------------------------------------------------


def _sender_main(conn: Connection, url: str, workdir: str, size: int) -> None:
    asyncio.run(_sender(conn, url, Path(workdir), size))


async def _sender(conn: Connection, url: str, workdir: Path, size: int) -> None:
    bus = await Bus.connect(url, "bench-trainer")
    state = {
        name: torch.rand(shape, generator=torch.Generator().manual_seed(i))
        for i, (name, shape) in enumerate(shapes(size).items())
    }
    publishers: dict[str, WeightPublisher] = {}
    conn.send(("ok", crcs(state)))
    loop = asyncio.get_running_loop()
    try:
        while True:
            command, args = await loop.run_in_executor(None, conn.recv)
            if command == "stop":
                break
            transport, step = args
            try:
                if transport not in publishers:
                    sender = None
                    if transport == "collective":
                        from services.weights.collective import CollectiveSender

                        sender = CollectiveSender(bus, "127.0.0.1", 0)
                    publishers[transport] = WeightPublisher(
                        bus, workdir / "out", transport=transport, keep_last=1, sender=sender
                    )
                    await publishers[transport].start()
                    if transport == "collective":
                        conn.send(("ok", None))  # listening: a receiver may join now
                        command, args = await loop.run_in_executor(None, conn.recv)
                event = await publishers[transport].publish(
                    RUN_ID, 0, step, state, LORA, kind="full"
                )
                conn.send(("ok", msgspec.json.encode(event)))
            except Exception as exc:  # reported, and the next transport is measured
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        for publisher in publishers.values():
            await publisher.close()
        await bus.close()


# --- a receiver (one process per measurement) -----------------------------------------------------


def _receiver_main(conn: Connection, url: str, workdir: str, size: int, transport: str, mode: str):
    asyncio.run(_receiver(conn, url, Path(workdir), size, transport, mode))


async def _receiver(
    conn: Connection, url: str, workdir: Path, size: int, transport: str, mode: str
) -> None:
    bus = await Bus.connect(url, "bench-replica")
    params = {name: torch.zeros(shape) for name, shape in shapes(size).items()}
    fetchers: dict[str, Any] = {}
    try:
        if transport == "collective":
            from services.weights.collective import CollectiveReceiver

            receiver = CollectiveReceiver(bus, "bench-replica")
            await receiver.start()
            await receiver.joined(timeout=60.0)
            if mode == "in place":
                receiver.receive_into(RUN_ID, params)
            fetchers["collective"] = receiver
        before = peak_rss()
        conn.send(("ok", None))
        loop = asyncio.get_running_loop()
        event = msgspec.json.decode(await loop.run_in_executor(None, conn.recv), type=WeightsReady)
        out = workdir / "out"
        if mode == "in place":
            await load_weights(bus, event, out, fetchers, destination=params)
        else:
            fresh = await load_weights(bus, event, out, fetchers)
            for name, tensor in fresh.items():
                params[name].copy_(tensor)
            del fresh
        rise = peak_rss() - before
        conn.send(("ok", (rise, crcs(params))))
        for fetcher in fetchers.values():
            await fetcher.close()
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        await bus.close()


def _answer(conn: Connection, who: str) -> Any:
    if not conn.poll(TIMEOUT):
        raise RuntimeError(f"the {who} stopped answering")
    status, value = conn.recv()
    if status == "error":
        raise RuntimeError(value)
    return value


def measure(
    ctx: Any,
    sender: Connection,
    url: str,
    workdir: Path,
    size: int,
    transport: str,
    mode: str,
    step: int,
    expected: dict[str, int],
    started: set[str],
) -> int:
    conn, theirs = ctx.Pipe()
    proc = ctx.Process(
        target=_receiver_main, args=(theirs, url, str(workdir), size, transport, mode), daemon=True
    )
    try:
        if transport == "collective" and transport not in started:
            sender.send(("publish", (transport, step)))
            _answer(sender, "sender")  # the sender's group is up
            started.add(transport)
            proc.start()
            _answer(conn, "receiver")
            sender.send(("go", None))
        else:
            proc.start()
            _answer(conn, "receiver")
            sender.send(("publish", (transport, step)))
        event = _answer(sender, "sender")
        conn.send(event)
        rise, got = _answer(conn, "receiver")
        if got != expected:
            raise RuntimeError("the installed tensors differ from those sent")
        return int(rise)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=float, default=256.0, help="model size in MB (2**20 bytes)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    args = parser.parse_args()
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    size = int(args.size * MB)
    for name, value in (
        ("UCX_TLS", "tcp"),
        ("UCX_WARN_UNUSED_ENV_VARS", "n"),
        ("GLOO_SOCKET_IFNAME", "lo"),
    ):
        os.environ.setdefault(name, value)
    ctx = mp.get_context("spawn")
    with (
        tempfile.TemporaryDirectory(prefix="plexrl-bench-full-") as tmp,
        EmbeddedNats(store_dir=Path(tmp) / "nats") as server,
    ):
        workdir = Path(tmp)
        sender, theirs = ctx.Pipe()
        proc = ctx.Process(
            target=_sender_main, args=(theirs, server.url, str(workdir), size), daemon=True
        )
        proc.start()
        expected = _answer(sender, "sender")
        model_bytes = sum(4 * r * c for r, c in shapes(size).values())
        print(
            f"torch {torch.__version__}, {os.cpu_count()} CPUs, model {model_bytes / MB:.0f} MB "
            "(float32); rise of the receiver's peak RSS while it installs one version\n"
        )
        print("| transport | in place | fresh tensors, then copied | in place / baseline |")
        print("| --- | ---: | ---: | ---: |")
        step, started = 0, set()
        for transport in transports:
            rises: dict[str, int | str] = {}
            for mode in ("fresh tensors, then copied", "in place"):
                step += 1
                try:
                    rises[mode] = measure(
                        ctx,
                        sender,
                        server.url,
                        workdir,
                        size,
                        transport,
                        mode,
                        step,
                        expected,
                        started,
                    )
                except Exception as exc:
                    rises[mode] = f"n/a ({exc})"
            base, mine = rises["fresh tensors, then copied"], rises["in place"]
            ratio = (
                f"{mine / base:.2f}x"
                if isinstance(base, int) and isinstance(mine, int) and base > 0
                else "n/a"
            )

            def show(value: int | str) -> str:
                if isinstance(value, str):
                    return value
                return f"{value / MB:,.0f} MB ({value / model_bytes:.2f} model)"

            print(f"| {transport} | {show(mine)} | {show(base)} | {ratio} |", flush=True)
        sender.send(("stop", None))
        proc.join(30)


if __name__ == "__main__":
    main()
