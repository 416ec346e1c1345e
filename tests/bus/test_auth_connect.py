"""``Bus.connect`` with credentials: PLEXRL_NATS_CREDS, PLEXRL_TENANT, and the clear errors of a
refused or unusable credential, against a real nats-server running the accounts of ``plexrl
nats-config``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nkeys
import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from schemas import RunSubmitted
from schemas import subjects as sj
from schemas.tenant import inbox_prefix
from services.bus import Bus, BusUnavailable, EmbeddedNats, free_port
from services.bus.bus import connect_options
from services.config import process_settings
from services.config.tenants import TenantQuota, TenantsFile, save_tenants
from services.registry.service import Registry
from services.registry.settings import RegistrySettings
from services.tenants.credentials import SERVICES, ensure_seed, seed_path
from services.tenants.nats_config import render_nats_config, users_of

ACME = "acme"


@pytest.fixture(scope="module")
def auth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("auth")
    save_tenants(d / "tenants.toml", TenantsFile(tenants={ACME: TenantQuota(max_runs=1)}))
    ensure_seed(seed_path(d, ACME))
    return d


@pytest.fixture(scope="module")
def auth_server(auth_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    conf, port = auth_dir / "nats.conf", free_port()
    store = tmp_path_factory.mktemp("authjs")
    conf.write_text(
        render_nats_config(users_of(auth_dir), listen=f"127.0.0.1:{port}", store_dir=store)
    )
    with EmbeddedNats(store_dir=store / "log", port=port, config=conf) as server:
        yield server


@pytest.fixture
async def registry(
    auth_server: EmbeddedNats, auth_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Registry]:
    """The registry, which answers a tenant's submits (the ingest)."""
    _as(monkeypatch, seed_path(auth_dir, SERVICES))
    bus = await Bus.connect(auth_server.url, "registry")
    settings = RegistrySettings(output_dir=tmp_path / "out", tenants_file=auth_dir / "tenants.toml")
    reg = Registry(bus, settings)
    await reg.start()
    yield reg
    await reg.stop()
    await bus.close()


def _as(monkeypatch: pytest.MonkeyPatch, creds: Path | None, tenant: str = "default") -> None:
    if creds is None:
        monkeypatch.delenv("PLEXRL_NATS_CREDS", raising=False)
    else:
        monkeypatch.setenv("PLEXRL_NATS_CREDS", str(creds))
    monkeypatch.setenv("PLEXRL_TENANT", tenant)


async def test_services_credentials_connect_and_provision(
    auth_server: EmbeddedNats, auth_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _as(monkeypatch, seed_path(auth_dir, SERVICES))
    bus = await Bus.connect(auth_server.url, "registry")
    try:
        names = {s.config.name for s in await bus.js.streams_info()}
        assert {sj.RUNS_STREAM, sj.ROLLOUTS_STREAM, "KV_plexrl-registry"} <= names
        assert bytes(bus.nc._inbox_prefix) == b"_INBOX"
    finally:
        await bus.close()


async def test_a_tenant_connects_with_its_inbox_prefix_and_publishes_its_own_submit(
    auth_server: EmbeddedNats, auth_dir: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    _as(monkeypatch, seed_path(auth_dir, ACME), ACME)
    # provisioning is skipped: the services own the streams
    bus = await Bus.connect(auth_server.url, "cli")
    try:
        assert bytes(bus.nc._inbox_prefix).decode() == inbox_prefix(ACME)
        event = RunSubmitted(run_id="run_acme1", config={"env": "reverse"}, submitted_by="test")
        ack = await bus.publish(sj.runs_subject("submit", ACME), event, msg_id="run_acme1/1")
        assert ack.stream == sj.RUNS_STREAM and ack.seq > 0  # the services' stream stored it
        names = {s.config.name for s in await bus.js.streams_info()}
        assert names == {sj.RUNS_STREAM, sj.WEIGHTS_STREAM}  # only its own views
    finally:
        await bus.close()


async def test_no_credentials_is_refused_with_a_clear_error(
    auth_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    _as(monkeypatch, None)
    # a refusal does not wait for the connect timeout: the message is the refusal's
    with pytest.raises(BusUnavailable) as refused:
        await Bus.connect(auth_server.url, "test", connect_timeout=30)
    message = str(refused.value)
    assert "authorization violation" in message
    assert "set PLEXRL_NATS_CREDS" in message


async def test_an_unknown_key_is_refused_naming_the_credential_file(
    auth_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stranger = tmp_path / "stranger.nk"
    ensure_seed(stranger)
    _as(monkeypatch, stranger)
    with pytest.raises(BusUnavailable) as refused:
        await Bus.connect(auth_server.url, "test", connect_timeout=30)
    message = str(refused.value)
    assert "authorization violation" in message
    assert str(stranger) in message
    assert "plexrl nats-config" in message


async def test_a_tenant_key_acting_as_the_default_tenant_reaches_nothing(
    auth_server: EmbeddedNats, auth_dir: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without PLEXRL_TENANT the client names the default tenant's subjects, which do not exist
    in the tenant's account: nothing answers."""
    _as(monkeypatch, seed_path(auth_dir, ACME))
    bus = await Bus.connect(auth_server.url, "cli", provision_streams=False)
    try:
        for subject in (sj.SUBMIT, sj.REGISTRY_LIST, sj.GENERATE):
            with pytest.raises((NatsTimeout, NoRespondersError)):
                await bus.nc.request(subject, b"{}", timeout=0.5)
    finally:
        await bus.close()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no such file"),
        (b"not a seed\n", "neither a user nkey seed"),
        (nkeys.encode_seed(b"\x01" * 32, nkeys.PREFIX_BYTE_ACCOUNT), "neither a user nkey seed"),
    ],
    ids=["missing", "garbage", "account-seed"],
)
async def test_unusable_credential_files_are_named_before_connecting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes | None, expected: str
) -> None:
    path = tmp_path / "creds.nk"
    if content is not None:
        path.write_bytes(content)
    _as(monkeypatch, path)
    # no server at all: the file is checked first
    with pytest.raises(BusUnavailable, match=expected) as refused:
        await Bus.connect(f"nats://127.0.0.1:{free_port()}", "test")
    assert str(path) in str(refused.value)


def test_a_creds_file_is_passed_as_user_credentials(tmp_path: Path) -> None:
    creds = tmp_path / "user.creds"
    creds.write_text(
        "-----BEGIN NATS USER JWT-----\neyJ0eXAi\n------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\nSUAM\n------END USER NKEY SEED------\n"
    )
    options = connect_options(process_settings({"PLEXRL_NATS_CREDS": str(creds)}))
    assert options == {"user_credentials": str(creds)}
    seed = tmp_path / "user.nk"
    ensure_seed(seed)
    options = connect_options(
        process_settings({"PLEXRL_NATS_CREDS": str(seed), "PLEXRL_TENANT": ACME})
    )
    assert options == {"nkeys_seed": str(seed), "inbox_prefix": "_INBOX_acme"}
    assert connect_options(process_settings({})) == {}


async def test_nothing_listening_still_fails_fast_with_credentials_set(
    auth_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _as(monkeypatch, seed_path(auth_dir, SERVICES))
    with pytest.raises(BusUnavailable, match="nothing accepts connections"):
        await Bus.connect(f"nats://127.0.0.1:{free_port()}", "test", connect_timeout=30)
