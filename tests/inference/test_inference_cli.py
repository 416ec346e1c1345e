"""``plexrl inference``: settings, a replica in its own process, SIGTERM, and tracing spans."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from inference_support import discover, lora_spec, random_adapter
from nats.errors import NoRespondersError
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from schemas.codec import decode, encode
from schemas.events import GenerateRequest, GenerateResponse
from schemas.subjects import GENERATE
from services.bus import Bus, setup_tracing
from services.cli import main
from services.config import SettingsError, load_settings
from services.inference.requests import REPLICA_HEADER
from services.inference.settings import InferenceSettings
from services.weights import WeightPublisher

REPO = Path(__file__).resolve().parents[2]


def test_settings_from_flags_environment_and_defaults(tmp_path: Path) -> None:
    settings = load_settings(
        InferenceSettings,
        overrides={"model": tmp_path, "max_runs": 8},
        environ={"PLEXRL_TARGET_MODULES": "q_proj, v_proj", "PLEXRL_MAX_RUNS": "2"},
    )
    assert settings.target_modules == ["q_proj", "v_proj"]
    assert settings.max_runs == 8  # a flag beats the environment
    assert settings.engine == "torch" and settings.batch_window_ms == 5.0
    with pytest.raises(SettingsError, match="model"):
        load_settings(InferenceSettings, environ={})
    with pytest.raises(SettingsError, match="replica_name"):
        load_settings(InferenceSettings, overrides={"model": tmp_path, "replica_name": "a.b"})


def test_a_missing_model_directory_is_a_usage_error(tmp_path: Path, capsys) -> None:
    assert main(["inference", "--model", str(tmp_path / "nowhere")]) == 2
    assert "plexrl model tiny" in capsys.readouterr().err


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys; from services.inference import cli; import argparse; "
        "p = argparse.ArgumentParser(); cli.register(p.add_subparsers()); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


async def test_a_replica_process_serves_and_stops_on_sigterm(
    bus: Bus, nats_url: str, tiny_dir: Path, uid: str, tmp_path: Path
) -> None:
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=3)
    name = f"cli-{uid}"
    env = os.environ | {"PLEXRL_NATS_URL": nats_url}
    log = (tmp_path / "replica.log").open("wb")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "services", "inference", "--model", str(tiny_dir)),
            *("--replica-name", name, "--threads", "1", "--output-dir", str(tmp_path)),
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        req = GenerateRequest(request_id=uid, run_id=run_id, prompts=[[1, 5, 6]], max_tokens=4)
        for _ in range(300):
            try:
                msg = await bus.nc.request(GENERATE, encode(req), timeout=5)
                break
            except NoRespondersError:
                assert proc.poll() is None, (tmp_path / "replica.log").read_text()
                await asyncio.sleep(0.2)
        else:
            raise AssertionError("the replica never answered")
        assert (msg.headers or {})[REPLICA_HEADER] == name
        resp: GenerateResponse = decode(msg.data, GenerateResponse)
        assert resp.error is None and len(resp.completions[0][0].token_ids) >= 1
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


async def test_generate_and_weights_load_spans_join_the_callers_traces(
    bus: Bus, uid: str, start_replica, scratch_lora, tmp_path: Path
) -> None:
    exporter = InMemorySpanExporter()
    setup_tracing("test", extra_processor=SimpleSpanProcessor(exporter))
    tracer = trace.get_tracer("test")
    _, lora = scratch_lora
    await start_replica()
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=2)
    with tracer.start_as_current_span("trainer step") as step_span:
        await WeightPublisher(bus, tmp_path).publish(
            run_id, 2, 1, random_adapter(lora, 0, 4, 8.0, seed=61), lora_spec()
        )
    with tracer.start_as_current_span("orchestrator step") as ask_span:
        req = GenerateRequest(
            request_id=uid, run_id=run_id, prompts=[[1, 7]], max_tokens=3, min_policy_version=1
        )
        resp = await bus.request(GENERATE, req, GenerateResponse, timeout=20)
    assert resp.policy_version == 1
    spans = [(s, dict(s.attributes or {})) for s in exporter.get_finished_spans()]
    ((load, load_attrs),) = [
        (s, a) for s, a in spans if s.name == "weights load" and a.get("run_id") == run_id
    ]
    assert load.context is not None
    assert load.context.trace_id == step_span.get_span_context().trace_id
    assert load_attrs["policy_version"] == 1 and load_attrs["idx"] == 2
    ((gen, gen_attrs),) = [
        (s, a) for s, a in spans if s.name == "generate" and a.get("run_id") == run_id
    ]
    assert gen.context is not None
    assert gen.context.trace_id == ask_span.get_span_context().trace_id
    assert gen.kind == trace.SpanKind.SERVER
    assert gen_attrs["policy_version"] == 1 and gen_attrs["idx"] == 2
    assert gen_attrs["tokens"] == len(resp.completions[0][0].token_ids)
