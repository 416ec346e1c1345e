"""``plexrl health <service>``, the check of local.yml and the probes of k8s/, against a real
nats-server with the deployments' credentials and a real registry process: healthy exactly while
that process answers from its event loop, on this host."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.bus import Bus, EmbeddedNats, free_port
from services.config.tenants import TenantQuota, TenantsFile, save_tenants
from services.launch.health import announce, check, this_host
from services.tenants.credentials import SERVICES, ensure_seed, seed_path
from services.tenants.nats_config import render_nats_config, users_of

TENANT = "team-a"


@pytest.fixture(scope="module")
def auth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("auth")
    save_tenants(d / "tenants.toml", TenantsFile(tenants={TENANT: TenantQuota(max_runs=1)}))
    ensure_seed(seed_path(d, SERVICES))
    ensure_seed(seed_path(d, TENANT))
    return d


@pytest.fixture(scope="module")
def auth_server(auth_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """A nats-server on the accounts of the services and one tenant, as plexrl nats-config
    writes them."""
    conf, port, store = auth_dir / "nats.conf", free_port(), tmp_path_factory.mktemp("healthjs")
    listen = f"127.0.0.1:{port}"
    conf.write_text(render_nats_config(users_of(auth_dir), listen=listen, store_dir=store))
    with EmbeddedNats(store_dir=store / "log", port=port, config=conf) as s:
        yield s


def _env(auth_dir: Path, who: str | None = SERVICES) -> dict[str, str]:
    """A clean environment holding ``who``'s credentials (none: ``None``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLEXRL_", "OTEL_"))}
    if who is not None:
        env["PLEXRL_NATS_CREDS"] = str(seed_path(auth_dir, who))
    if who not in (None, SERVICES):
        env["PLEXRL_TENANT"] = who
    return env


def _health(url: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services", "health", *args, "--nats-url", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _check(url: str, service: str, host: str | None, timeout: float = 3.0) -> tuple[bool, str]:
    return asyncio.run(check(url, service, host, timeout))


@pytest.fixture(scope="module", autouse=True)
def as_the_services(auth_dir: Path) -> Iterator[None]:
    """The checks made in this process connect as the services do."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLEXRL_NATS_CREDS", str(seed_path(auth_dir, SERVICES)))
        mp.delenv("PLEXRL_TENANT", raising=False)
        yield


def _start_registry(
    url: str, auth_dir: Path, out: Path, service: str = "registry"
) -> subprocess.Popen[bytes]:
    """``plexrl registry`` as deployed (the services' seed) under the name ``service``, once it
    answers health pings."""
    log = out / "registry.log"
    argv = ["registry", "--nats-url", url, "--output-dir", str(out / "runs")]
    argv += ["--service", service, "--consumer-name", service]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services", *argv],
            env=_env(auth_dir),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 90
    while not _check(url, service, this_host(), timeout=1.0)[0]:
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise AssertionError(f"the registry never answered:\n{log.read_text()}")
        time.sleep(0.3)
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def registry(
    auth_server: EmbeddedNats, auth_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[bytes]]:
    """One registry for the tests that only ask it."""
    proc = _start_registry(auth_server.url, auth_dir, tmp_path_factory.mktemp("registry"))
    yield proc
    _stop(proc)


def test_healthy_while_the_service_answers(
    auth_server: EmbeddedNats, auth_dir: Path, registry: subprocess.Popen[bytes]
) -> None:
    host = this_host()
    result = _health(auth_server.url, _env(auth_dir), "registry")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(
        f"healthy: plexrl-registry answers: pid {registry.pid} on {host} "
        "(connection plexrl-registry), "
    )
    assert result.stdout.count("\n") == 1  # one line: what Docker and kubectl show

    # another service, or the same one on another host, is not this container's process
    ok, message = _check(auth_server.url, "trainer", host, timeout=1.0)
    assert (ok, message) == (False, f"unhealthy: no plexrl-trainer on {host} answered within 1 s")
    ok, message = _check(auth_server.url, "registry", "elsewhere", timeout=1.0)
    assert not ok
    assert message == (
        "unhealthy: no plexrl-registry on elsewhere answered within 1 s (answered elsewhere: "
        f"pid {registry.pid} on {host} (connection plexrl-registry))"
    )
    ok, message = _check(auth_server.url, "registry", None)
    assert ok and f"pid {registry.pid}" in message


def test_unhealthy_while_frozen_and_once_stopped(
    auth_server: EmbeddedNats, auth_dir: Path, tmp_path: Path
) -> None:
    # a name of its own (PLEXRL_SERVICE), as the module's registry runs on this host too
    name = "registry-b"
    registry = _start_registry(auth_server.url, auth_dir, tmp_path, service=name)
    try:
        os.kill(registry.pid, signal.SIGSTOP)  # alive to the kernel, answering nothing
        ok, message = _check(auth_server.url, name, this_host(), timeout=1.5)
        assert (ok, message) == (
            False,
            f"unhealthy: no plexrl-{name} on {this_host()} answered within 1.5 s",
        )
        os.kill(registry.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not _check(auth_server.url, name, this_host(), timeout=1.0)[0]:
            assert time.monotonic() < deadline, "the registry did not answer again after SIGCONT"

        registry.terminate()
        assert registry.wait(timeout=30) == 0
        result = _health(auth_server.url, _env(auth_dir), name, "--timeout", "1")
        assert result.returncode == 1
        assert (
            result.stdout == f"unhealthy: no plexrl-{name} on {this_host()} answered within 1 s\n"
        )
    finally:
        _stop(registry)


def test_only_the_services_credentials_may_ask(
    auth_server: EmbeddedNats, auth_dir: Path, registry: subprocess.Popen[bytes]
) -> None:
    anonymous = _health(auth_server.url, _env(auth_dir, None), "registry", "--timeout", "1")
    assert anonymous.returncode == 1
    assert anonymous.stdout.startswith("unhealthy: NATS at ")
    assert "PLEXRL_NATS_CREDS" in anonymous.stdout
    # a tenant's credentials reach NATS, but its account holds no service of the services
    tenant = _health(auth_server.url, _env(auth_dir, TENANT), "registry", "--timeout", "1")
    assert tenant.returncode == 1
    assert tenant.stdout.startswith("unhealthy: no plexrl-registry on ")


def test_unhealthy_without_nats_and_refuses_a_bad_name(auth_dir: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    result = _health(url, _env(auth_dir), "registry")
    assert result.returncode == 1
    assert result.stdout.startswith(f"unhealthy: cannot reach NATS at {url}")
    bad = _health(url, _env(auth_dir), "reg.istry")
    assert bad.returncode == 2
    assert "illegal service name 'reg.istry'" in bad.stderr


async def test_a_process_acting_for_a_tenant_registers_nothing(
    auth_server: EmbeddedNats, auth_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``plexrl orchestrator`` run by a tenant: no deployment probes it, and its account is not
    where the services' health checks look."""
    monkeypatch.setenv("PLEXRL_NATS_CREDS", str(seed_path(auth_dir, TENANT)))
    monkeypatch.setenv("PLEXRL_TENANT", TENANT)
    bus = await Bus.connect(auth_server.url, "orchestrator")
    try:
        assert await announce(bus, "orchestrator") is None
    finally:
        await bus.close()
    monkeypatch.setenv("PLEXRL_NATS_CREDS", str(seed_path(auth_dir, SERVICES)))
    monkeypatch.delenv("PLEXRL_TENANT")
    bus = await Bus.connect(auth_server.url, "orchestrator")
    try:
        service = await announce(bus, "orchestrator")
        assert service is not None
        ok, message = await check(auth_server.url, "orchestrator", this_host(), timeout=2.0)
        assert ok, message
        assert f"pid {os.getpid()} on {this_host()} (connection plexrl-orchestrator)" in message
        await service.stop()
        ok, _ = await check(auth_server.url, "orchestrator", this_host(), timeout=1.0)
        assert not ok
    finally:
        await bus.close()
