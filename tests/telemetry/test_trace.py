"""One step of a run is one trace across the services of ``plexrl up``.

``plexrl up`` (one run, two steps, the untrained tiny model) exports its spans over OTLP/HTTP to
a receiver this test runs. The trace of step 0 must hold the whole chain, with every parent
link inside the trace: orchestrator step -> generate request -> inference "generate"; the
RolloutBatch publish -> trainer step (pack, forward_backward, optimizer) -> the WeightsReady
publish -> inference "weights load".
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from otlp_receiver import Receiver, Span, render_tree

from schemas.subjects import GENERATE, rollouts_subject, weights_subject
from services.model.tiny import build_tiny_model

RUN_ID = "run_reverse"
TREE_KEYS = ("run_id", "step", "policy_version")


def _ancestors(span: Span, by_id: dict[str, Span]) -> list[Span]:
    out = []
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        out.append(span)
    return out


def _step_trace(spans: list[Span], run_id: str, step: int) -> tuple[Span, list[Span]]:
    roots = [
        s
        for s in spans
        if s.name == "orchestrator step"
        and s.attributes.get("run_id") == run_id
        and s.attributes.get("step") == step
    ]
    assert len(roots) == 1, f"expected one 'orchestrator step' for {run_id} step {step}: {roots}"
    return roots[0], [s for s in spans if s.trace_id == roots[0].trace_id]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> list[Span]:
    tmp = tmp_path_factory.mktemp("trace")
    model = build_tiny_model(tmp / "model", seed=0)
    with Receiver() as receiver:
        env = {
            **os.environ,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
        env.pop("OTEL_SERVICE_NAME", None)
        env.pop("PLEXRL_NATS_URL", None)
        up = subprocess.run(
            [
                *(sys.executable, "-m", "services", "up", "--runs", "1", "--steps", "2"),
                *("--max-async-level", "1", "--model", str(model)),
                *("--output-dir", str(tmp / "out"), "--no-live"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert up.returncode == 0, f"plexrl up failed:\n{up.stdout}\n{up.stderr}"
        # Every process flushes at exit; allow the last export a moment to be handled.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            names = {s.name for s in receiver.snapshot()}
            if {"orchestrator step", "trainer step", "weights load"} <= names:
                break
            time.sleep(0.1)
        return receiver.snapshot()


def test_one_step_is_one_trace_across_the_services(exported: list[Span]) -> None:
    root, trace = _step_trace(exported, RUN_ID, 0)
    tree = render_tree(trace, root, TREE_KEYS)
    print(tree)  # pytest shows it when an assertion fails
    by_id = {s.span_id: s for s in trace}

    assert root.parent_id == "" and root.service == "plexrl-orchestrator", tree
    orphans = [s for s in trace if s is not root and s.parent_id not in by_id]
    assert not orphans, f"spans whose parent is not in the trace: {orphans}\n{tree}"
    assert {s.service for s in trace} == {
        "plexrl-orchestrator",
        "plexrl-inference",
        "plexrl-trainer",
    }, tree

    # orchestrator -> inference: each served generate hangs off one request of this step
    served = [s for s in trace if s.name == "generate" and s.service == "plexrl-inference"]
    assert served, tree
    for s in served:
        client = by_id[s.parent_id]
        assert client.name == f"request {GENERATE}" and client.service == "plexrl-orchestrator"
        assert client.parent_id == root.span_id
        assert s.attributes.get("run_id") == RUN_ID
    assert any(s.name == "score" and s.parent_id == root.span_id for s in trace), tree

    # orchestrator -> trainer: the trainer step descends from the RolloutBatch publish
    publish = [s for s in trace if s.name == f"publish {rollouts_subject(RUN_ID)}"]
    assert len(publish) == 1 and publish[0].parent_id == root.span_id, tree
    steps = [s for s in trace if s.name == "trainer step"]
    assert len(steps) == 1, tree
    trainer_step = steps[0]
    assert trainer_step.service == "plexrl-trainer"
    assert trainer_step.attributes.get("run_id") == RUN_ID
    assert trainer_step.attributes.get("step") == 0
    assert publish[0] in _ancestors(trainer_step, by_id), tree
    phases = {s.name for s in trace if s.parent_id == trainer_step.span_id}
    assert {"pack", "forward_backward", "optimizer"} <= phases, tree

    # trainer -> inference: the new adapter's load descends from the WeightsReady publish
    announce = [s for s in trace if s.name == f"publish {weights_subject(RUN_ID)}"]
    assert len(announce) == 1 and trainer_step in _ancestors(announce[0], by_id), tree
    loads = [s for s in trace if s.name == "weights load"]
    assert len(loads) == 1, tree
    assert loads[0].service == "plexrl-inference"
    assert loads[0].attributes.get("policy_version") == 1
    assert announce[0] in _ancestors(loads[0], by_id), tree


def test_admission_is_its_own_trace_through_the_registry(exported: list[Span]) -> None:
    """The registry is not in a step's chain: it appears in the run's admission trace."""
    submits = [s for s in exported if s.name == "publish plexrl.runs.submit"]
    assert len(submits) == 1 and submits[0].service == "plexrl-orchestrator"
    trace = [s for s in exported if s.trace_id == submits[0].trace_id]
    by_id = {s.span_id: s for s in trace}
    print(render_tree(trace, submits[0]))
    handled = [s for s in trace if s.name == "handle plexrl.runs.submit"]
    assert len(handled) == 1 and handled[0].service == "plexrl-registry"
    assert handled[0].parent_id == submits[0].span_id
    discovered = [s for s in trace if s.name == "publish plexrl.runs.discovered"]
    assert len(discovered) == 1 and handled[0] in _ancestors(discovered[0], by_id)
    assert not any(s.service == "plexrl-registry" for s in _step_trace(exported, RUN_ID, 0)[1])
