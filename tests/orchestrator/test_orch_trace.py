"""One trace per step: the step span is the parent of its requests, its scoring and its publish."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.bus import Bus, setup_tracing
from services.orchestrator.run_loop import RunOrchestrator
from services.registry.service import Registry

from .conftest import RUN, orch_config
from .replica import ScriptedReplica

_spans = InMemorySpanExporter()
setup_tracing("test", extra_processor=SimpleSpanProcessor(_spans))


async def test_each_step_is_one_trace(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    _spans.clear()
    orch = RunOrchestrator(
        obus,
        RUN,
        orch_config(max_steps=2, max_async_level=2),
        output_dir=out,
        tokenizer=tokenizer,
        request_timeout=5.0,
        wait_for_training=False,
    )
    assert (await asyncio.wait_for(orch.run(asyncio.Event()), 20)).status == "done"
    finished = _spans.get_finished_spans()
    steps = [s for s in finished if s.name == "orchestrator step"]
    assert [s.attributes["step"] for s in steps if s.attributes] == [0, 1]
    assert len({s.context.trace_id for s in steps}) == 2  # a trace of its own for each step
    for step in steps:
        assert step.attributes is not None
        assert step.attributes["run_id"] == RUN
        assert step.attributes["policy_version"] == 0
        children = [s for s in finished if s.parent and s.parent.span_id == step.context.span_id]
        assert sorted(s.name for s in children) == [
            f"publish plexrl.rollouts.{RUN}",
            "request plexrl.inference.generate",
            "request plexrl.inference.generate",
            "score",
        ]
        assert {s.context.trace_id for s in children} == {step.context.trace_id}
