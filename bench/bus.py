"""Bus layer vs raw nats-py, measured in the same run on the same server.

As deployed, the publisher (an orchestrator) and the consumer (the trainer) are separate
processes: here the consumer runs in a child process. For a small event (RunEvicted) and a
~256 KiB RolloutBatch (JSON, and MessagePack as the bus can send it):

- throughput: N messages published back to back (each awaiting its PubAck) while the child
  handles them; messages per second from the first publish to the last handled;
- latency: one message every few milliseconds, publish -> handled, p50 and p99
  (``time.monotonic`` is one clock for every process on the machine).

Three paths, the same bytes on the wire:
- ``raw``: nats-py ``js.publish`` of pre-encoded bytes; the consumer acks without decoding;
- ``raw+codec``: the same plus msgspec encode per publish and typed decode per message, what a
  service would do without the bus layer;
- ``bus``: ``Bus.publish`` and ``Consumer.run``: typed encode, headers (Nats-Msg-Id,
  traceparent), a span per publish and per handle, typed decode, the verdict boundary.
Every consumer acks with ``ack_sync``. Also msgspec MB/s.

    .venv/bin/python bench/bus.py [--n 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from schemas import RolloutBatch, RunEvicted, Sample, decode, encode
from schemas.codec import Format
from services.bus import Bus, Consumer, Delivery, EmbeddedNats, setup_tracing


def small_event() -> RunEvicted:
    return RunEvicted(run_id="run_bench", idx=3, reason="bench")


def rollout_batch(target_bytes: int = 256 * 1024) -> RolloutBatch:
    def sample(i: int) -> Sample:
        return Sample(
            prompt_ids=list(range(i % 50, i % 50 + 32)),
            completion_ids=[(i * 7 + t) % 90 for t in range(128)],
            completion_logprobs=[-0.123456789 - t * 1e-3 for t in range(128)],
            reward=0.5,
            advantage=-0.25,
        )

    samples: list[Sample] = []
    while (
        len(encode(RolloutBatch(run_id="run_bench", step=1, policy_version=1, samples=samples)))
        < target_bytes
    ):
        samples.append(sample(len(samples)))
    return RolloutBatch(run_id="run_bench", step=1, policy_version=1, samples=samples)


# --- the consumer process ---------------------------------------------------------------------


async def _consume(
    url: str, subject: str, path: str, event_type: Any, expected: int, conn: Connection
) -> None:
    setup_tracing("bench-consumer")
    bus = await Bus.connect(url, "bench", provision_streams=False)
    handled: dict[str, float] = {}
    done = asyncio.Event()
    stop = asyncio.Event()

    def mark(mid: str) -> None:
        handled[mid] = time.monotonic()
        if len(handled) >= expected:
            done.set()

    durable = f"{path.replace('+', '_')}_{uuid.uuid4().hex[:8]}"
    if path in ("raw", "raw+codec"):
        sub = await bus.js.pull_subscribe(subject, durable=durable, stream="PLEXRL_RUNS")

        async def loop() -> None:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(32, timeout=0.2)
                except TimeoutError:
                    continue
                for m in msgs:
                    if path == "raw+codec":
                        decode(m.data, event_type, (m.headers or {}).get("Content-Type"))
                    await m.ack_sync()
                    mark((m.headers or {})["Nats-Msg-Id"])

        await sub.consumer_info()
        conn.send("ready")
        task = asyncio.create_task(loop())
        await done.wait()
        stop.set()
        await task
        await sub.unsubscribe()
    else:
        consumer: Consumer[Any] = Consumer(
            bus,
            stream="PLEXRL_RUNS",
            durable=durable,
            filter_subject=subject,
            event_type=event_type,
        )

        async def handler(ev: Any, d: Delivery) -> None:
            mark(d.headers["Nats-Msg-Id"])

        await consumer.start()
        conn.send("ready")
        task = asyncio.create_task(consumer.run(handler, stop))
        await done.wait()
        stop.set()
        await task
        await consumer.close()
    conn.send(handled)
    await bus.close()


def _consumer_main(
    url: str, subject: str, path: str, event_type: Any, expected: int, conn: Connection
) -> None:
    asyncio.run(_consume(url, subject, path, event_type, expected, conn))


# --- the publishing side ----------------------------------------------------------------------


async def run_path(
    bus: Bus, url: str, path: str, event: msgspec.Struct, fmt: Format, n: int, latency_n: int
) -> dict[str, float]:
    subject = f"plexrl.runs.bench.{uuid.uuid4().hex[:10]}"
    payload = encode(event, fmt)
    headers_raw = {"Content-Type": "application/msgpack"} if fmt == "msgpack" else {}
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(
        target=_consumer_main, args=(url, subject, path, type(event), n + latency_n, child)
    )
    proc.start()
    assert parent.recv() == "ready"
    sent: dict[str, float] = {}

    async def publish(mid: str) -> None:
        sent[mid] = time.monotonic()
        if path == "raw":
            await bus.js.publish(subject, payload, headers={"Nats-Msg-Id": mid, **headers_raw})
        elif path == "raw+codec":
            await bus.js.publish(
                subject, encode(event, fmt), headers={"Nats-Msg-Id": mid, **headers_raw}
            )
        else:
            await bus.publish(subject, event, msg_id=mid, fmt=fmt)

    ids = [uuid.uuid4().hex for _ in range(n)]
    for mid in ids:
        await publish(mid)
    lat_ids = [uuid.uuid4().hex for _ in range(latency_n)]
    await asyncio.sleep(0.05)
    for mid in lat_ids:
        await asyncio.sleep(0.004 if len(payload) < 10_000 else 0.015)
        await publish(mid)
    handled: dict[str, float] = await asyncio.to_thread(parent.recv)
    proc.join()
    elapsed = max(handled[i] for i in ids) - sent[ids[0]]
    lat = sorted(handled[i] - sent[i] for i in lat_ids)
    return {
        "msgs_per_s": n / elapsed,
        "p50_ms": 1e3 * lat[len(lat) // 2],
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
    }


def codec_speed(event: msgspec.Struct, seconds: float = 0.5) -> dict[str, float]:
    out = {}
    for fmt in ("json", "msgpack"):
        data = encode(event, fmt)  # type: ignore[arg-type]
        ctype = "application/msgpack" if fmt == "msgpack" else None
        for op in ("encode", "decode"):
            count, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                if op == "encode":
                    encode(event, fmt)  # type: ignore[arg-type]
                else:
                    decode(data, type(event), ctype)
                count += 1
            out[f"{fmt} {op}"] = count * len(data) / (time.perf_counter() - t0) / 1e6
    return out


async def main(n: int, repeats: int) -> None:
    setup_tracing("bench")
    big = rollout_batch()
    cases: list[tuple[str, msgspec.Struct, Format, int]] = [
        ("small event, JSON", small_event(), "json", n),
        ("256 KiB RolloutBatch, JSON", big, "json", max(100, n // 10)),
        ("256 KiB RolloutBatch, MessagePack", big, "msgpack", max(100, n // 10)),
    ]
    with EmbeddedNats() as server:
        bus = await Bus.connect(server.url, "bench")
        rows: list[str] = []
        ratios: list[tuple[str, float, float, float, float]] = []
        for name, event, fmt, count in cases:
            paths = ["raw", "raw+codec", "bus"]
            results: dict[str, list[dict[str, float]]] = {p: [] for p in paths}
            for r in range(repeats):
                # rotate the order so drift on a noisy machine hits every path alike
                for path in paths[r % 3 :] + paths[: r % 3]:
                    results[path].append(
                        await run_path(bus, server.url, path, event, fmt, count, 200)
                    )
            med = {
                p: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
                for p, rs in results.items()
            }
            size = len(encode(event, fmt))
            for p, label in (
                ("raw", "raw nats-py"),
                ("raw+codec", "raw nats-py + msgspec"),
                ("bus", "plexrl bus"),
            ):
                m = med[p]
                rows.append(
                    f"| {name} | {size / 1024:.1f} KiB | {label} | {m['msgs_per_s']:.0f} | "
                    f"{m['p50_ms']:.2f} | {m['p99_ms']:.2f} |"
                )
            bus_m, raw_m, codec_m = med["bus"], med["raw"], med["raw+codec"]
            ratios.append(
                (
                    name,
                    raw_m["msgs_per_s"] / bus_m["msgs_per_s"],
                    bus_m["p50_ms"] / raw_m["p50_ms"],
                    codec_m["msgs_per_s"] / bus_m["msgs_per_s"],
                    bus_m["p50_ms"] / codec_m["p50_ms"],
                )
            )
        await bus.close()
    print("| payload | size | path | msgs/s | p50 ms | p99 ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print()
    print(
        "| payload | vs raw: throughput cost | vs raw: p50 | "
        "vs raw+msgspec: throughput cost | vs raw+msgspec: p50 | target |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, thr, lat, cthr, clat in ratios:
        print(f"| {name} | {thr:.2f}x | {lat:.2f}x | {cthr:.2f}x | {clat:.2f}x | ≤ 1.2x |")
    print()
    print("| codec (256 KiB RolloutBatch) | MB/s |")
    print("| --- | --- |")
    for k, v in codec_speed(big).items():
        print(f"| msgspec {k} | {v:.0f} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=2000, help="messages per throughput run (small event)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    asyncio.run(main(a.n, a.repeats))
