"""A tenant's Node.js client (tests/js/tenants.test.mjs) on the accounts of ``plexrl
nats-config`` with a real registry: it works for its own runs, gets clear errors for malformed
messages, and reaches nothing of another tenant's, whose stored messages are checked here, before
and after, to be exactly what they were."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from accounts_support import accounts_broker
from victim_support import COMMANDS_RUN, eventually, status_of, stream_messages, submit

from schemas import subjects as sj
from services.config.tenants import TenantQuota
from services.registry.service import Registry
from services.registry.settings import RegistrySettings
from services.tenants.credentials import SERVICES

REPO = Path(__file__).resolve().parents[2]
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(
    NODE is None or not (REPO / "tests/js/node_modules/@nats-io/transport-node").is_dir(),
    reason="needs node and `npm install --prefix tests/js` (scripts/bootstrap.sh does it)",
)


async def test_a_tenants_node_client_works_for_its_own_runs_and_reaches_no_other(
    tmp_path: Path,
) -> None:
    tenants = {"acme": TenantQuota(), "beta": TenantQuota()}
    with accounts_broker(tmp_path, tenants) as broker:
        services = await broker.connect(SERVICES, "registry")
        settings = RegistrySettings(output_dir=tmp_path / "out", tenants_file=broker.tenants_file)
        registry = Registry(services, settings)
        await registry.start()
        beta = await broker.connect("beta")
        try:
            await submit(beta, "beta", "run_beta", COMMANDS_RUN)
            await eventually(lambda: _active(beta, "run_beta"))
            before = await stream_messages(services, sj.RUNS_STREAM, "plexrl.runs.beta.>")
            env = os.environ | {
                "PLEXRL_TEST_NATS_URL": broker.url,
                "PLEXRL_TEST_SEED": str(broker.seed("acme")),
                "PLEXRL_TEST_TENANT": "acme",
                "PLEXRL_TEST_OTHER_TENANT": "beta",
            }
            assert NODE is not None
            # not subprocess.run: the registry answering the client runs on this event loop
            node = await asyncio.create_subprocess_exec(
                NODE,
                "--test",
                "tenants.test.mjs",
                cwd=REPO / "tests" / "js",
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            output, _ = await asyncio.wait_for(node.communicate(), 120)
            stdout = output.decode(errors="replace")
            assert node.returncode == 0, stdout
            assert "# pass 4" in stdout and "# skipped 0" in stdout, stdout
            assert registry.records["run_node"].tenant == "acme"
            after = await stream_messages(services, sj.RUNS_STREAM, "plexrl.runs.beta.>")
            assert after == before and len(before) == 2  # beta's submit and its RunDiscovered
            assert await status_of(beta, "beta", "run_beta") == "active"
        finally:
            await beta.close()
            await registry.stop()
            await services.close()


async def _active(bus, run_id: str) -> bool:  # type: ignore[no-untyped-def]
    return await status_of(bus, "beta", run_id) == "active"
