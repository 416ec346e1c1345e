"""End to end: ``plexrl up`` with real services, a third run joining and one run evicted.

One scenario, several assertions: ``plexrl up`` trains two runs (reverse, copy) on its own
NATS server; once they are under way a third run (add) is started by ``plexrl orchestrator``
against the same stack and must join without disturbing them; then ``plexrl evict`` evicts the
copy run, whose orchestrator must stop with the reason while the others go on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console

from schemas.config import dump_toml
from services.bus import EmbeddedNats
from services.up.app import ensure_tiny_model
from services.up.settings import UpSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Long enough that the third run (whose process start alone takes seconds) joins and the copy
# run is evicted while both demo runs are still training; the assertions check that it did.
STEPS = 150
JOIN_STEPS = 4
EVICT_REASON = "e2e: operator evicts the copy run"


@dataclass
class Scenario:
    output_dir: Path
    up_code: int
    up_output: str
    join_code: int
    join_output: str
    evicted_at_step: int


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services", *args]


def _metrics(output_dir: Path, run_id: str) -> list[dict]:
    path = output_dir / run_id / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _trained(output_dir: Path, run_id: str) -> list[dict]:
    path = output_dir / run_id / "trainer_steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"plexrl up exited ({proc.returncode}) before {what}:\n{out}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    root = tmp_path_factory.mktemp("e2e")
    # PLEXRL_E2E_MODEL reuses a model built before (any warm-started tiny model directory);
    # by default the test builds its own, as `plexrl up` does on first use.
    given = os.environ.get("PLEXRL_E2E_MODEL")
    model = (
        Path(given) if given else ensure_tiny_model(Console(stderr=True), cache_dir=root / "cache")
    )
    out = root / "outputs"
    with EmbeddedNats(store_dir=root / "nats") as server:
        up = subprocess.Popen(
            _cli("up", "--runs", "2", "--steps", str(STEPS), "--max-async-level", "1", "--output-dir", str(out),
                 "--model", str(model), "--nats-url", server.url, "--no-live"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            _wait(lambda: len(_metrics(out, "run_reverse")) >= 2, 300, "run_reverse step 2", up)
            join_cfg = root / "join.toml"
            cfg = UpSettings(steps=JOIN_STEPS).run_config("add", seed=7).to_dict()
            join_cfg.write_text(dump_toml(cfg))
            join = subprocess.run(
                _cli("orchestrator", "run_join", "--config", str(join_cfg), "--output-dir", str(out),
                     "--model", str(model), "--nats-url", server.url),
                capture_output=True, text=True, timeout=400,
            )  # fmt: skip
            evicted_at = len(_metrics(out, "run_copy"))
            evict = subprocess.run(
                _cli("evict", "run_copy", "--reason", EVICT_REASON, "--nats-url", server.url),
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert evict.returncode == 0, evict.stdout + evict.stderr
            try:
                up_out, _ = up.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                up.kill()
                up_out, _ = up.communicate()
                raise AssertionError(_stuck_report(out, up_out)) from None
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()
    return Scenario(
        out, up.returncode, up_out, join.returncode, join.stdout + join.stderr, evicted_at
    )


def _stuck_report(out: Path, up_out: str) -> str:
    """What a ``plexrl up`` that did not finish had done: step counts, its output, log tails."""
    lines = ["plexrl up did not finish within 600 s"]
    for run in sorted(out.glob("run_*")):
        lines.append(f"{run.name}: {len(_metrics(out, run.name))} steps sampled, "
                     f"{len(_trained(out, run.name))} trained")  # fmt: skip
    lines += ["--- plexrl up output (last 40 lines) ---", *up_out.splitlines()[-40:]]
    for log in sorted((out / "logs").glob("*.log")):
        lines += [f"--- {log.name} (last 15 lines) ---", *log.read_text().splitlines()[-15:]]
    return "\n".join(lines)


def _window(values: list[float], fraction: float = 0.2) -> tuple[float, float]:
    k = max(1, round(len(values) * fraction))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def test_surviving_run_trains_every_step_exactly_once(scenario: Scenario) -> None:
    steps = [int(m["step"]) for m in _metrics(scenario.output_dir, "run_reverse")]
    assert steps == list(range(STEPS)), scenario.up_output
    trained = [int(t["step"]) for t in _trained(scenario.output_dir, "run_reverse")]
    assert trained == list(range(STEPS))  # contiguous, none twice, none skipped


def test_async_bound_holds(scenario: Scenario) -> None:
    for run_id in ("run_reverse", "run_copy", "run_join"):
        for m in _metrics(scenario.output_dir, run_id):
            assert 0 <= int(m["policy_lag"]) <= 1, (run_id, m)
        for t in _trained(scenario.output_dir, run_id):
            assert int(t["batch_policy_version"]) >= int(t["step"]) - 1, (run_id, t)


def test_runs_learn(scenario: Scenario) -> None:
    rows = _metrics(scenario.output_dir, "run_reverse")
    # Learned, not only sharpened: greedy on held-out prompts beats the base at its best
    # temperature (the warm start's slip, stopping a letter early, is what RL unlearns).
    final = rows[-1]
    assert final["heldout_greedy"] >= final["base_best"] + 0.1, final
    # The training reward rises within the first few dozen steps: compare the first 5% of the
    # steps with the last 20%.
    rewards = [float(m["reward_mean"]) for m in rows]
    first, last = _window(rewards, 0.05)[0], _window(rewards)[1]
    assert last >= first + 0.1, rewards


def test_third_run_joins_without_disturbing_the_others(scenario: Scenario) -> None:
    assert scenario.join_code == 0, scenario.join_output
    steps = [int(m["step"]) for m in _metrics(scenario.output_dir, "run_join")]
    assert steps == list(range(JOIN_STEPS))
    trained = [int(t["step"]) for t in _trained(scenario.output_dir, "run_join")]
    assert trained == list(range(JOIN_STEPS))
    # the first two runs kept their slots: run_join got the next free index
    record = json.loads((scenario.output_dir / "summary.json").read_text())
    assert record["run_reverse"]["status"] == "done"


def test_evicted_run_stops_with_the_reason_while_others_go_on(scenario: Scenario) -> None:
    assert scenario.up_code == 3, scenario.up_output  # an evicted run makes `up` exit 3
    summary = json.loads((scenario.output_dir / "summary.json").read_text())
    assert summary["run_copy"]["status"] == "evicted"
    assert EVICT_REASON in summary["run_copy"]["reason"]
    assert (
        EVICT_REASON in (scenario.output_dir / "run_copy" / "control" / "evicted.txt").read_text()
    )
    copy_steps = [int(m["step"]) for m in _metrics(scenario.output_dir, "run_copy")]
    assert copy_steps == list(range(len(copy_steps)))
    assert scenario.evicted_at_step <= len(copy_steps) < STEPS
    assert summary["run_reverse"]["steps"] == STEPS
    assert (scenario.output_dir / "run_reverse" / "reward.png").stat().st_size > 1000
