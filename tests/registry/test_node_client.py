"""A client in another language: Node.js submits runs as plain JSON (tests/js/registry_submit.mjs).

Needs ``node`` and ``npm``; installs tests/js's packages itself when they are missing.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from schemas import subjects as sj
from schemas.config import OrchConfig, parse_orch_config
from schemas.events import InvalidMessage, RunDiscovered
from services.bus import Bus, EmbeddedNats

from .conftest import RegistryFactory
from .helpers import error_reports, events_on

JS_DIR = Path(__file__).resolve().parents[1] / "js"
SCRIPT = JS_DIR / "registry_submit.mjs"
NODE = shutil.which("node")
NPM = shutil.which("npm")

pytestmark = pytest.mark.skipif(NODE is None or NPM is None, reason="needs node and npm")


def _ensure_packages() -> None:
    modules = JS_DIR / "node_modules" / "@nats-io"
    if not ((modules / "transport-node").is_dir() and (modules / "jetstream").is_dir()):
        assert NPM is not None
        subprocess.run(
            [NPM, "install", "--no-audit", "--no-fund"],
            cwd=JS_DIR,
            check=True,
            capture_output=True,
            timeout=600,
        )


async def test_node_submits_a_run_and_a_malformed_message_is_rejected(
    make_registry: RegistryFactory, server: EmbeddedNats, rbus: Bus, out: Path
) -> None:
    await asyncio.to_thread(_ensure_packages)
    await make_registry()
    assert NODE is not None
    proc = await asyncio.create_subprocess_exec(
        NODE,
        str(SCRIPT),
        server.url,
        "run_node_a",
        "run_node_b",
        "--malformed",
        "--wait",
        "20",
        cwd=JS_DIR,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stdout.decode() + stderr.decode()
    lines = [json.loads(line) for line in stdout.decode().splitlines()]
    answers = {line["run_id"]: (line["answer"], line["idx"]) for line in lines if "answer" in line}
    # run_node_b was submitted after the malformed message: the registry kept serving
    assert answers == {"run_node_a": ("run_discovered", 0), "run_node_b": ("run_discovered", 1)}

    discovered = await events_on(rbus, sj.DISCOVERED, RunDiscovered)
    expected = OrchConfig.model_validate(
        {
            "env": "reverse",
            "max_steps": 20,
            "batch_size": 4,
            "group_size": 4,
            "model": {"lora": {"rank": 8, "alpha": 16}},
        }
    )
    assert [(e.run_id, e.config_digest) for e in discovered] == [
        ("run_node_a", expected.digest()),
        ("run_node_b", expected.digest()),
    ]
    written = out / "run_node_a" / "control" / "orch.toml"
    assert parse_orch_config(written.read_text()).digest() == expected.digest()

    [report] = await error_reports(rbus)
    assert isinstance(report, InvalidMessage)
    assert report.subject == sj.SUBMIT and report.service == "registry"
    assert "truncated" in report.error.lower()
    assert report.leading_bytes == b'{"type": "run_submitted", "run_id": '
