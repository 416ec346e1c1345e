"""Two tenants train at once on one set of services, each in an account of its own.

A nats-server running the accounts of ``plexrl tenants add`` and ``plexrl nats-config`` for
``acme`` and ``beta``. The registry, trainer and inference run with the services' seed; one
``plexrl orchestrator`` per tenant runs with ``PLEXRL_TENANT`` and that tenant's seed, so its
submit and its rollouts reach the services only through the registry's checks, and it follows
its run in the views the registry keeps in its account. Both runs must be trained to their last
step, each RunDiscovered must name its tenant, each run's WeightsReady must land on its
tenant's weights subject, and each tenant's own view must hold its run's events.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from accounts_support import AccountsBroker, accounts_broker
from up_support import clean_env, plexrl

from schemas import subjects as sj
from schemas.codec import decode
from schemas.events import RunDiscovered, WeightsReady
from services.config.tenants import TenantQuota
from services.model.tiny import build_tiny_model
from services.runs.progress import read_progress
from services.tenants.credentials import SERVICES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TENANTS = {"acme": "run_acme", "beta": "run_beta"}
MAX_STEPS = 3
RUN_CONFIG = f"""env = "reverse"
max_steps = {MAX_STEPS}
batch_size = 2
group_size = 2
max_async_level = 1

[model.lora]
rank = 4
alpha = 8

[optim]
lr = 1e-3

[sampling]
temperature = 1.0
max_tokens = 4
"""


class Processes:
    """Child processes with their logs, stopped (and their logs kept) at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - lives with the process
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env or clean_env()
        )
        log.close()

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} still running after {timeout}s:\n{self.log(name)}"
            ) from None

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    p = Processes(tmp_path / "logs")
    yield p
    p.stop()


async def test_two_tenants_train_side_by_side(tmp_path: Path, procs: Processes) -> None:
    with accounts_broker(tmp_path, {t: TenantQuota() for t in TENANTS}) as broker:
        await _train_side_by_side(tmp_path, procs, broker)


async def _train_side_by_side(tmp_path: Path, procs: Processes, broker: AccountsBroker) -> None:
    model = build_tiny_model(tmp_path / "model", seed=0)
    out = tmp_path / "out"
    sizes = ["--max-runs", "4", "--max-lora-rank", "8"]
    bus = await broker.connect(SERVICES)  # provisions the streams
    try:
        services = clean_env() | broker.env(SERVICES)
        procs.start(
            "registry",
            plexrl("registry", "--output-dir", str(out), *sizes),
            services | {"PLEXRL_TENANTS_FILE": str(broker.tenants_file)},
        )
        for service in ("inference", "trainer"):
            argv = [service, "--model", str(model), "--output-dir", str(out), "--threads", "1"]
            procs.start(service, plexrl(*argv, *sizes), services)
        for tenant, run_id in TENANTS.items():
            config = tmp_path / f"{run_id}.toml"
            config.write_text(RUN_CONFIG)
            argv = ["orchestrator", run_id, "--config", str(config), "--model", str(model)]
            tenant_env = clean_env() | broker.env(tenant)
            procs.start(
                f"orchestrator-{tenant}", plexrl(*argv, "--output-dir", str(out)), tenant_env
            )

        for tenant in TENANTS:
            name = f"orchestrator-{tenant}"
            assert procs.wait(name, 240) == 0, procs.log(name)

        for tenant, run_id in TENANTS.items():
            progress = await read_progress(bus, run_id)
            assert progress is not None and progress.step == MAX_STEPS, (tenant, progress)
            raw = await bus.js.get_last_msg(sj.RUNS_STREAM, sj.runs_subject("discovered", tenant))
            discovered: RunDiscovered = decode(raw.data or b"", RunDiscovered)
            assert (discovered.run_id, discovered.tenant) == (run_id, tenant)
            weights = await bus.js.get_last_msg(
                sj.WEIGHTS_STREAM, sj.tenant_weights_subject(run_id, tenant)
            )
            ready: WeightsReady = decode(weights.data or b"", WeightsReady)
            assert (ready.run_id, ready.step) == (run_id, MAX_STEPS)
            # nothing of a tenant's run went to the default tenant's subjects
            for subject in (sj.weights_subject(run_id), sj.rollouts_subject(run_id)):
                stream = sj.WEIGHTS_STREAM if ".weights." in subject else sj.ROLLOUTS_STREAM
                with pytest.raises(Exception, match=r"not found|NotFound|no message"):
                    await bus.js.get_last_msg(stream, subject)
            # the tenant's own view holds its run's events, and no other tenant's
            mine = await broker.connect(tenant)
            try:
                seen = await mine.js.get_last_msg(sj.WEIGHTS_STREAM, f"plexrl.weights.{tenant}.>")
                assert decode(seen.data or b"", WeightsReady).step == MAX_STEPS
                names = {i.config.name for i in await mine.js.streams_info()}
                assert names == {sj.RUNS_STREAM, sj.WEIGHTS_STREAM}
                other = next(t for t in TENANTS if t != tenant)
                with pytest.raises(Exception, match=r"not found|NotFound|no message"):
                    await mine.js.get_last_msg(sj.RUNS_STREAM, f"plexrl.runs.{other}.>")
            finally:
                await mine.close()
    finally:
        await bus.close()
