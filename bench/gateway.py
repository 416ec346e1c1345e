"""The Tinker gateway: many clients sharing the trainer, and what the HTTP layer costs.

A whole plexrl on loopback (nats-server, registry, trainer, inference and gateway, each its own
process, the tiny model), driven by the stock ``tinker`` SDK:

(a) ``--runs`` training clients (one LoRA run each) doing ``forward_backward`` (cross_entropy on
    a fixed per-run batch) + ``optim_step`` for ``--steps`` steps, all at once from one thread
    per client, against the same work one run after another through one client (the way a
    server that swaps adapters in and out serves them). Reported: samples per second of each.
    The trainer puts the ``forward_backward`` calls that arrive together in shared micro-batches.
(b) gateway overhead: one run's ``forward`` through the SDK and HTTP against the same request
    sent as a ``ForwardBackwardRequest`` on NATS directly (median of ``--repeats``, the two ways
    alternating), for a small request (4 x 48 tokens) and a larger one (64 x 200 tokens): the
    HTTP layer's cost is fixed per call, so its ratio depends on how much work a call carries.

    .venv/bin/python bench/gateway.py [--runs 8] [--steps 4] [--repeats 15] [--device cuda]

With ``--load`` it measures the gateway under sampling load instead (bench/gateway_load.py):
offered against served requests, latency, errors by status and the co-located RL runs' step
time, with a plot.

    .venv/bin/python bench/gateway.py --load [--levels 0,8,32,128,512] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from schemas.training import Datum, ForwardBackwardRequest, ForwardBackwardResult, train_subject
from services.bus import Bus, EmbeddedNats, free_port
from services.model.loader import load_tokenizer
from services.model.tiny import build_tiny_model

ALIAS = "tiny-base"


class Stack:
    """The services as processes, stopped on exit."""

    def __init__(self, root: Path, device: str, max_runs: int) -> None:
        self.root = root
        self.model = build_tiny_model(root / "model", seed=0)
        self.nats = EmbeddedNats(store_dir=root / "nats")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.device = device
        self.max_runs = max_runs
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Stack:
        self.nats.start()
        out = str(self.root / "out")
        common = ("--nats-url", self.nats.url)
        runs = ("--max-runs", str(self.max_runs))
        self._start("registry", "--output-dir", out, *runs, *common)
        self._start(
            "trainer", "--model", str(self.model), "--output-dir", out, *runs,
            "--device", self.device, *common,
        )  # fmt: skip
        self._start("inference", "--model", str(self.model), "--output-dir", out, *runs, *common)
        self._start(
            "gateway", "--model", str(self.model), "--port", str(self.port),
            "--model-alias", ALIAS, *common,
        )  # fmt: skip
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise SystemExit("the gateway did not come up; see the logs under " + str(self.root))

    def _start(self, name: str, *args: str) -> None:
        log = (self.root / f"{name}.log").open("ab")
        env = os.environ | {"PLEXRL_CONNECT_WAIT_S": "30", "PLEXRL_THREADS": "1"}
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "services", name, *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        log.close()

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.nats.close()


def batch(tok: Any, run: int, rows: int = 4, length: int = 48) -> list[Any]:
    """A fixed cross-entropy batch for run ``run``: ``rows`` sequences of ``length`` tokens."""
    from tinker import types

    data = []
    for r in range(rows):
        text = "".join("abcdefghij"[(run * 7 + r * 3 + i) % 10] for i in range(length))
        ids = [tok.bos_token_id, *tok.encode(text, add_special_tokens=False)][: length + 1]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(
                        data=ids[1:], dtype="int64", shape=[len(ids) - 1]
                    ),
                },
            )
        )
    return data


def train(client: Any, data: list[Any], steps: int) -> None:
    from tinker import types

    for _ in range(steps):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def bench_clients(stack: Stack, runs: int, steps: int) -> dict[str, float]:
    """Samples per second: every client at once, then one after another."""
    import tinker

    service = tinker.ServiceClient(base_url=stack.url, api_key="tml-bench")
    tok = load_tokenizer(stack.model)
    clients = [
        service.create_lora_training_client(base_model=ALIAS, rank=8).result() for _ in range(runs)
    ]
    data = [batch(tok, i) for i in range(runs)]
    for client, d in zip(clients, data, strict=True):  # warm-up: one step each, in turn
        train(client, d, 1)
    samples = runs * steps * len(data[0])

    started = time.monotonic()
    for client, d in zip(clients, data, strict=True):
        train(client, d, steps)
    one_by_one = samples / (time.monotonic() - started)

    threads = [
        threading.Thread(target=train, args=(c, d, steps))
        for c, d in zip(clients, data, strict=True)
    ]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    together = samples / (time.monotonic() - started)
    return {"together": together, "one_by_one": one_by_one}


def bench_overhead(stack: Stack, repeats: int, rows: int, length: int) -> dict[str, float]:
    import tinker

    tok = load_tokenizer(stack.model)
    data = batch(tok, 0, rows, length)
    service = tinker.ServiceClient(base_url=stack.url, api_key="tml-bench")
    client = service.create_lora_training_client(base_model=ALIAS, rank=8).result()
    direct_data = [
        Datum(
            model_input=d.model_input.to_ints(),
            loss_fn_inputs={
                "target_tokens": [float(t) for t in d.loss_fn_inputs["target_tokens"].data]
            },
        )
        for d in data
    ]

    async def direct_times() -> list[float]:
        bus = await Bus.connect(stack.nats.url, "bench", provision_streams=False)
        try:
            times = []
            for i in range(repeats + 2):
                req = ForwardBackwardRequest(
                    request_id=f"direct-{i}-{time.time_ns()}",
                    run_id=client.model_id,
                    data=direct_data,
                    forward_only=True,
                )
                started = time.monotonic()
                result = await bus.request(
                    train_subject("forward_backward"), req, ForwardBackwardResult, timeout=60
                )
                assert result.error is None, result.error
                times.append(time.monotonic() - started)
            return times[2:]
        finally:
            await bus.close()

    gateway, direct = [], []
    for _ in range(3):  # alternate the two ways, so both see the same machine
        for _ in range(max(1, repeats // 3) + 1):
            started = time.monotonic()
            client.forward(data, "cross_entropy").result()
            gateway.append(time.monotonic() - started)
        direct += asyncio.run(direct_times())
    return {"gateway": statistics.median(gateway[1:]), "direct": statistics.median(direct)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    load = parser.add_argument_group("--load: sampling load beside RL runs (gateway_load.py)")
    load.add_argument("--load", action="store_true", help="measure the gateway under load")
    load.add_argument(
        "--levels",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[0, 8, 32, 128, 512],
        help="concurrent clients per level, 0 first (the baseline)",
    )
    load.add_argument("--seconds", type=float, default=20.0, help="length of each level")
    load.add_argument("--rl-runs", type=int, default=2, help="demo RL runs training meanwhile")
    load.add_argument("--n", type=int, default=4, help="completions per request")
    load.add_argument("--max-tokens", type=int, default=16, help="tokens per completion")
    load.add_argument("--http-share", type=float, default=0.25, help="inference's http_share")
    load.add_argument("--plot", default="", help="write the plot here (PNG)")
    args = parser.parse_args()
    if args.load:
        if not args.levels or args.levels[0] != 0:
            parser.error("--levels must start with 0, the baseline")
        from gateway_load import run as run_load

        run_load(args)
        return
    with (
        tempfile.TemporaryDirectory(prefix="plexrl-bench-gateway-") as tmp,
        Stack(Path(tmp), args.device, args.runs + 2) as stack,
    ):
        clients = bench_clients(stack, args.runs, args.steps)
        overheads = {
            size: bench_overhead(stack, args.repeats, *size) for size in ((4, 48), (64, 200))
        }
    ratio = clients["together"] / clients["one_by_one"]
    print(
        f"\n{args.device.upper()}, tiny model, {args.runs} runs x {args.steps} steps x 4 samples\n"
    )
    print("| measurement | value | ratio | baseline | target |")
    print("| --- | ---: | ---: | --- | --- |")
    print(
        f"| (a) samples/s, {args.runs} Tinker clients at once | {clients['together']:.1f} | "
        f"{ratio:.2f}x | one after another through one client: {clients['one_by_one']:.1f} | "
        ">= 1.5x |"
    )
    for (rows, length), overhead in overheads.items():
        over = overhead["gateway"] / overhead["direct"]
        print(
            f"| (b) one forward of {rows} x {length} tokens through the gateway (SDK, HTTP) | "
            f"{overhead['gateway'] * 1000:.1f} ms | {over:.2f}x | the same "
            f"ForwardBackwardRequest on NATS: {overhead['direct'] * 1000:.1f} ms | <= 1.2x |"
        )


if __name__ == "__main__":
    main()
