"""Recovery from a dead inference replica: time from the SIGKILL of the only replica, while it
holds a generate request, to that request's completion, as ``plexrl up`` sees it (the replica
is started again 1 s after it died; the request's version is published once the new one runs).

Both ways in the same run: ``progress_every_s = 0`` (no progress messages: the request is sent
again only when the orchestrator's 120 s request timeout runs out) and the default 2 s (the
replica's progress messages stop, and the request is sent again after 3 missed beats + 2 s).
Prints one line per setting and the ratio.

    .venv/bin/python bench/recovery.py [--every 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from schemas.events import GenerateRequest, LoraSpec, RunDiscovered
from schemas.subjects import DISCOVERED
from services.bus import Bus, EmbeddedNats
from services.model.loader import load_model
from services.model.lora import DEFAULT_TARGET_MODULES, MultiLoRA
from services.model.tiny import build_tiny_model
from services.orchestrator.client import GenerateClient
from services.weights import WeightPublisher

REPO = Path(__file__).resolve().parents[1]
RUN = "run_measure"


def replica(url: str, model: Path, name: str, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "services", "inference", "--model", str(model)),
            *("--replica-name", name, "--threads", "1", "--output-dir", str(out)),
        ],
        cwd=REPO,
        env=os.environ | {"PLEXRL_NATS_URL": url},
        stdout=(out / f"{name}.log").open("wb"),
        stderr=subprocess.STDOUT,
    )


async def measure(every: float) -> float:
    tmp = Path(tempfile.mkdtemp())
    model = build_tiny_model(tmp / "model", seed=0)
    with EmbeddedNats(store_dir=tmp / "nats") as server:
        bus = await Bus.connect(server.url, "measure")
        config = {"model": {"lora": {"rank": 4, "alpha": 8.0}}}
        await bus.publish(DISCOVERED, RunDiscovered(run_id=RUN, idx=0, config=config))
        first = replica(server.url, model, "first", tmp)
        client = GenerateClient(bus, timeout=120.0, progress_every_s=every, max_backoff=1.0)
        req = GenerateRequest(
            request_id="held",
            run_id=RUN,
            prompts=[[1, 5, 6]],
            max_tokens=3,
            min_policy_version=1,
            timeout_s=600.0,
        )
        task = asyncio.create_task(client.generate(req))
        # wait until the first replica holds the request (its log says it is serving, and a
        # moment more for the request to reach it)
        while b"serving" not in (tmp / "first.log").read_bytes():
            await asyncio.sleep(0.1)
        await asyncio.sleep(3.0)
        first.kill()
        killed = time.monotonic()
        first.wait()
        await asyncio.sleep(1.0)  # plexrl up restarts a crashed service after 1 s
        second = replica(server.url, model, "second", tmp)
        scratch, _ = load_model(model)
        lora = MultiLoRA.attach(scratch, n_adapters=1, max_rank=8)
        lora.reset_slot(0, 4, 8.0, seed=1)
        spec = LoraSpec(rank=4, alpha=8.0, target_modules=list(DEFAULT_TARGET_MODULES))
        await WeightPublisher(bus, tmp).publish(RUN, 0, 1, lora.slot_state_dict(0), spec)
        resp = await task
        took = time.monotonic() - killed
        second.kill()
        second.wait()
        await bus.close()
    print(
        f"progress_every_s={every:g}: SIGKILL -> completed request in {took:.1f}s "
        f"(error={resp.error}, policy_version={resp.policy_version}, retries={client.retries}, "
        f"progress heard={client.progress_received})",
        flush=True,
    )
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=2.0, help="progress_every_s (default 2)")
    args = parser.parse_args()
    baseline = asyncio.run(measure(0.0))
    with_progress = asyncio.run(measure(args.every))
    print(f"recovery with progress / without: {with_progress / baseline:.3f}")


if __name__ == "__main__":
    main()
