"""End to end: sweeps. A 2x2 grid through ``plexrl up`` with two run slots (two runs wait in the
registry's queue), and ``plexrl sweep`` with successive halving against services already
running, followed by ``plexrl runs --sweep``."""

from __future__ import annotations

import csv
import hashlib
import json
import subprocess
import time
from pathlib import Path

import pytest
from up_support import clean_env, plexrl, run_up

from services.bus import EmbeddedNats
from services.model.tiny import build_tiny_model
from services.up.halving import score, select_evictions
from services.up.sweep import EarlyStop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SMALL_RUNS = """
[run]
batch_size = 2
group_size = 4
[run.sampling]
max_tokens = 6
[run.ckpt]
interval = 100
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_2x2_sweep_trains_4_distinct_runs_through_the_waiting_queue(
    model: Path, tmp_path: Path
) -> None:
    config = tmp_path / "sweep.toml"
    config.write_text(
        f'steps = 4\nmax_runs = 2\n{SMALL_RUNS}\n[sweep]\n"optim.lr" = [1e-3, 4e-3]\nseed = [0, 1]\n'
    )
    out = tmp_path / "out"
    up = run_up(out, "--config", str(config), "--model", str(model))
    ids = ["run_reverse-lr1e-3-s0", "run_reverse-lr1e-3-s1", "run_reverse-lr4e-3-s0",
           "run_reverse-lr4e-3-s1"]  # fmt: skip
    adapters = set()
    for run_id in ids:
        assert [m["step"] for m in _lines(out / run_id / "metrics.jsonl")] == [0, 1, 2, 3]
        assert [t["step"] for t in _lines(out / run_id / "trainer_steps.jsonl")] == [0, 1, 2, 3]
        adapter = out / run_id / "checkpoints" / "step_4" / "adapter" / "adapter_model.safetensors"
        adapters.add(hashlib.sha256(adapter.read_bytes()).hexdigest())
        assert run_id in up.stdout  # the comparison table
    assert len(adapters) == 4  # four adapters trained apart
    # two slots for four runs: two waited, and got the indices the finished runs freed
    registry_log = (out / "logs" / "registry.log").read_text()
    assert registry_log.count("waits for a free index") == 2, registry_log
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run_id"], r["optim.lr"], r["seed"], r["status"], r["steps"]) for r in rows] == [
        (run_id, lr, seed, "done", "4")
        for run_id, lr, seed in zip(ids, ["0.001", "0.001", "0.004", "0.004"], "0101", strict=True)
    ]
    report = json.loads((out / "sweep.json").read_text())
    assert report["sweep"] == "reverse" and [r["run_id"] for r in report["runs"]] == ids
    assert all(0 <= r["policy_lag_mean"] <= 1 and r["steps_per_s"] > 0 for r in report["runs"])
    assert (out / "sweep.png").stat().st_size > 10_000


def _start(name: str, argv: list[str], logs: Path) -> subprocess.Popen:
    log = open(logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        plexrl(name, *argv), stdout=log, stderr=subprocess.STDOUT, env=clean_env()
    )


def _wait_for(path: Path, text: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} in {path} after {timeout}s")


def test_plexrl_sweep_halves_on_a_running_deployment(
    model: Path, server: EmbeddedNats, tmp_path: Path
) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    common = ["--max-runs", "5", "--max-lora-rank", "16", "--nats-url", server.url]
    worker = ["--model", str(model), "--output-dir", str(out), "--threads", "1", *common]
    procs = [
        _start("registry", ["--output-dir", str(out), *common], logs),
        _start("inference", [*worker, "--engine", "torch"], logs),
        _start("trainer", worker, logs),
    ]
    try:
        _wait_for(logs / "inference.log", "serving")
        _wait_for(logs / "trainer.log", "slots")
        config = tmp_path / "sweep.toml"
        config.write_text(
            f'steps = 20\n{SMALL_RUNS}\n[sweep]\nname = "lrs"\n'
            '"optim.lr" = [1e-4, 1e-3, 4e-3, 1e-2]\n'
            "[sweep.early_stop]\nafter_steps = 3\nkeep = 0.5\nwindow = 2\n"
        )
        sweep = subprocess.run(
            plexrl("sweep", str(config), "--nats-url", server.url, "--output-dir", str(out),
                   "--model", str(model), "--no-live"),
            capture_output=True, text=True, timeout=240, env=clean_env(),
        )  # fmt: skip
        assert sweep.returncode == 0, sweep.stdout + sweep.stderr
        report = json.loads((out / "sweep-lrs" / "sweep.json").read_text())["runs"]
        assert (out / "sweep-lrs" / "sweep.png").exists()
        scores = {
            r["run_id"]: score([m["reward_mean"] for m in _lines(out / r["run_id"] / "metrics.jsonl")],
                               EarlyStop(after_steps=3, keep=0.5, window=2))
            for r in report
        }  # fmt: skip
        stopped = select_evictions(scores, 0.5)
        assert len(stopped) == 2
        for r in report:
            if r["run_id"] in stopped:
                assert r["status"] == "evicted (early stop)" and 3 <= r["steps"] < 20, r
                evicted_txt = (out / r["run_id"] / "control" / "evicted.txt").read_text()
                assert "successive halving at step 3" in evicted_txt
            else:
                assert r["status"] == "done" and r["steps"] == 20, r

        # a run outside the sweep whose id starts like the sweep's is not listed
        other = tmp_path / "other.toml"
        other.write_text('env = "copy"\n')
        submit = subprocess.run(plexrl("submit", "run_lrs2", str(other), "--wait", "30",
                                       "--nats-url", server.url), capture_output=True, text=True)  # fmt: skip
        assert submit.returncode == 0, submit.stdout + submit.stderr
        runs = subprocess.run(plexrl("runs", "--sweep", "lrs", "--json", "--nats-url", server.url),
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        listed = {row["run_id"]: row for row in map(json.loads, runs.stdout.splitlines())}
        assert set(listed) == set(scores)
        for run_id in stopped:
            assert "successive halving" in listed[run_id]["detail"]
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
