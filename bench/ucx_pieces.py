"""UCX fetches of an adapter made of many small tensors, against the same bytes as one tensor.

A LoRA adapter is hundreds of small tensors (a 7B model at rank 16: 448 matrices of about
128 KiB). A server process holds three streams of the same number of float32 bytes (``--size``
MB, MB = 2**20 bytes): one tensor (the baseline: the same bytes in the fewest messages), and
``--tensors`` equal tensors; a client process fetches each ``--repeats`` times with
``UcxWeightClient.fetch`` (verified, as a replica does; small tensors share pieces of the
bucket plan). Prints the median fetch time and MB/s of each, and each against the one-tensor
baseline measured in the same run.

    .venv/bin/python bench/ucx_pieces.py [--size 56] [--tensors 448] [--repeats 20]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection

import torch

from schemas.events import LoraSpec, WeightsReady
from services.weights.stream import EncodedStream

MB = 1 << 20
LORA = LoraSpec(rank=16, alpha=32.0, target_modules=["q_proj"])


def _state(size: int, tensors: int) -> dict[str, torch.Tensor]:
    per = size // 4 // tensors
    generator = torch.Generator().manual_seed(0)
    return {f"t{i:04d}.weight": torch.rand(per, generator=generator) for i in range(tensors)}


def _server(conn: Connection, size: int, tensors: int) -> None:
    async def main() -> None:
        from services.weights.ucx import UcxWeightServer

        server = UcxWeightServer("127.0.0.1", 0, keep_last=2)
        await server.start()
        out = []
        for step, count in ((1, 1), (2, tensors)):
            stream = EncodedStream.from_state_dict(_state(size, count))
            location = await server.send("run_bench", step, stream)
            out.append((location, stream.digest, stream.size))
        conn.send(out)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await server.close()

    asyncio.run(main())


async def _fetch_times(events: list[tuple[str, WeightsReady]], repeats: int) -> dict[str, float]:
    from services.weights import ucx

    client = ucx.UcxWeightClient()
    times: dict[str, list[float]] = {name: [] for name, _ in events}
    try:
        for _ in range(repeats):
            for name, event in events:  # the paths take turns
                start = time.perf_counter()
                await client.fetch(event)
                times[name].append(time.perf_counter() - start)
    finally:
        await client.close()
    return {name: statistics.median(ts[1:]) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=float, default=56.0, help="MB per stream")
    parser.add_argument("--tensors", type=int, default=448)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    size = int(args.size * MB)
    ctx = mp.get_context("spawn")
    conn, theirs = ctx.Pipe()
    proc = ctx.Process(target=_server, args=(theirs, size, args.tensors), daemon=True)
    proc.start()
    (one, many) = conn.recv()

    def event(step: int, where: tuple[str, str, int]) -> WeightsReady:
        location, digest, nbytes = where
        return WeightsReady(
            run_id="run_bench",
            idx=0,
            step=step,
            transport="ucx",
            location=location,
            digest=digest,
            size_bytes=nbytes,
            lora=LORA,
        )

    paths = [
        ("1 tensor", event(1, one)),
        (f"{args.tensors} tensors, bucketed", event(2, many)),
    ]
    try:
        medians = asyncio.run(_fetch_times(paths, args.repeats + 1))
    finally:
        conn.send("stop")
        proc.join(30)
    base = medians["1 tensor"]
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, UCX_TLS={os.environ['UCX_TLS']}, "
        f"{args.size:g} MB per stream, median of {args.repeats} fetches (verified)\n"
    )
    print("| stream | fetch | MB/s | time vs 1 tensor |")
    print("| --- | ---: | ---: | ---: |")
    for name, _ in paths:
        seconds = medians[name]
        print(
            f"| {name} | {seconds * 1e3:.1f} ms | {size / MB / seconds:,.0f} | {seconds / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
