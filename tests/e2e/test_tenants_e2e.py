"""Two tenants train at once on one set of services, each confined to its own subjects.

A nats-server with the production permission lists (services/tenants/permissions.py) for users
``acme`` and ``beta`` and an all-subjects user for the services, here by user and password. The
registry, trainer and inference run as the services' user; one ``plexrl orchestrator`` per
tenant runs with ``PLEXRL_TENANT`` and that tenant's credentials. Both runs must be trained to
their last step, each RunDiscovered must name its tenant, and each run's WeightsReady must land
on its tenant's weights subject.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from up_support import clean_env, plexrl

from schemas import subjects as sj
from schemas.codec import decode
from schemas.events import RunDiscovered, WeightsReady
from services.bus import Bus
from services.bus.server import find_nats_server, free_port
from services.config.tenants import TenantQuota, TenantsFile, save_tenants
from services.model.tiny import build_tiny_model
from services.runs.progress import read_progress
from services.tenants.permissions import tenant_permissions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PASSWORD = "pw"
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


def server_config(store: Path, port: int) -> str:
    users: list[dict[str, object]] = [{"user": "svc", "password": PASSWORD}]
    for tenant in TENANTS:
        perms = tenant_permissions(tenant)
        users.append(
            {
                "user": tenant,
                "password": PASSWORD,
                "permissions": {
                    "publish": {"allow": list(perms.publish or ())},
                    "subscribe": {"allow": list(perms.subscribe or ())},
                },
            }
        )
    return (
        f"listen: 127.0.0.1:{port}\n"
        "max_payload: 8388608\n"
        f'jetstream {{\n  store_dir: "{store}"\n}}\n'
        f"authorization {{\n  users: {json.dumps(users)}\n}}\n"
    )


def url(port: int, user: str) -> str:
    return f"nats://{user}:{PASSWORD}@127.0.0.1:{port}"


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
    port = free_port()
    (tmp_path / "nats.conf").write_text(server_config(tmp_path / "js", port))
    procs.start("nats", [find_nats_server(), "-c", str(tmp_path / "nats.conf")])
    model = build_tiny_model(tmp_path / "model", seed=0)
    out = tmp_path / "out"
    tenants_file = tmp_path / "tenants.toml"
    save_tenants(tenants_file, TenantsFile(tenants={t: TenantQuota() for t in TENANTS}))

    svc_url = url(port, "svc")
    sizes = ["--max-runs", "4", "--max-lora-rank", "8"]
    bus = None
    for _ in range(100):  # the server needs a moment to listen; the bus provisions the streams
        try:
            bus = await Bus.connect(svc_url, "test")
            break
        except Exception:
            time.sleep(0.05)
    assert bus is not None, procs.log("nats")
    try:
        env = clean_env() | {"PLEXRL_TENANTS_FILE": str(tenants_file)}
        procs.start(
            "registry",
            plexrl("registry", "--output-dir", str(out), *sizes, "--nats-url", svc_url),
            env,
        )
        for service in ("inference", "trainer"):
            argv = [service, "--model", str(model), "--output-dir", str(out), "--threads", "1"]
            procs.start(service, plexrl(*argv, *sizes, "--nats-url", svc_url))
        for tenant, run_id in TENANTS.items():
            config = tmp_path / f"{run_id}.toml"
            config.write_text(RUN_CONFIG)
            argv = ["orchestrator", run_id, "--config", str(config), "--model", str(model)]
            tenant_env = clean_env() | {
                "PLEXRL_TENANT": tenant,
                "PLEXRL_NATS_URL": url(port, tenant),
            }
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
    finally:
        await bus.close()
