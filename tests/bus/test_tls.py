"""TLS as a setting: a nats-server with a certificate from a CA made in the test, and clients
that trust that CA through PLEXRL_TLS_CA (and present a certificate where the server asks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pki import Pki, make_pki

from schemas import RunSubmitted
from schemas.subjects import SUBMIT
from services.bus import Bus, BusUnavailable, EmbeddedNats
from services.tenants.nats_config import Tls, render_tls


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    tls = render_tls(Tls(cert=pki.server_cert, key=pki.server_key))
    with EmbeddedNats(store_dir=tmp_path_factory.mktemp("tlsjs"), extra_config=tls) as server:
        yield server


@pytest.fixture(scope="module")
def mutual_tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    tls = render_tls(Tls(cert=pki.server_cert, key=pki.server_key, ca=pki.ca, verify=True))
    with EmbeddedNats(store_dir=tmp_path_factory.mktemp("mtlsjs"), extra_config=tls) as server:
        yield server


def _submit(run_id: str) -> RunSubmitted:
    return RunSubmitted(run_id=run_id, config={"env": "reverse"}, submitted_by="tls test")


async def test_a_client_that_trusts_the_ca_connects_and_publishes(
    tls_server: EmbeddedNats, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLEXRL_TLS_CA", str(pki.ca))
    bus = await Bus.connect(tls_server.url, "test")
    try:
        assert bus.nc._server_info["tls_required"] is True
        ack = await bus.publish(SUBMIT, _submit("run_tls"), msg_id="run_tls/1")
        assert ack.stream == "PLEXRL_RUNS" and ack.seq >= 1
        stored = await bus.js.get_msg("PLEXRL_RUNS", ack.seq)
        assert b"run_tls" in (stored.data or b"")
    finally:
        await bus.close()


async def test_a_client_without_the_ca_is_refused_with_a_clear_error(
    tls_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PLEXRL_TLS_CA", raising=False)
    with pytest.raises(BusUnavailable) as refused:
        await Bus.connect(tls_server.url, "test", connect_timeout=30)
    message = str(refused.value)
    assert "TLS failed" in message
    assert "certificate verify failed" in message
    assert "set PLEXRL_TLS_CA" in message


async def test_a_client_that_trusts_another_ca_is_refused(
    tls_server: EmbeddedNats, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLEXRL_TLS_CA", str(pki.other_ca))
    with pytest.raises(BusUnavailable, match="certificate verify failed") as refused:
        await Bus.connect(tls_server.url, "test", connect_timeout=30)
    assert str(pki.other_ca) in str(refused.value)


async def test_a_client_with_tls_settings_refuses_a_plain_server(
    server: EmbeddedNats, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLEXRL_TLS_CA", str(pki.ca))
    with pytest.raises(BusUnavailable, match="does not speak TLS"):
        await Bus.connect(server.url, "test")


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"PLEXRL_TLS_CA": "/nonexistent/ca.pem"}, "/nonexistent/ca.pem"),
        ({"PLEXRL_TLS_CERT": "client.pem"}, "set both PLEXRL_TLS_CERT and PLEXRL_TLS_KEY"),
        ({"PLEXRL_TLS_KEY": "client-key.pem"}, "set both PLEXRL_TLS_CERT and PLEXRL_TLS_KEY"),
        ({"PLEXRL_TLS_CA": "server-key.pem"}, "server-key.pem"),  # a key is not a CA
    ],
)
async def test_unusable_tls_files_are_named_before_connecting(
    server: EmbeddedNats,
    pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    variables: dict[str, str],
    expected: str,
) -> None:
    for name, value in variables.items():
        path = value if value.startswith("/") else str(pki.ca.parent / value)
        monkeypatch.setenv(name, path)
    with pytest.raises(BusUnavailable, match="TLS") as refused:
        await Bus.connect(server.url, "test")
    assert expected in str(refused.value)


async def test_mutual_tls_needs_a_client_certificate(
    mutual_tls_server: EmbeddedNats, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLEXRL_TLS_CA", str(pki.ca))
    with pytest.raises(BusUnavailable) as refused:
        await Bus.connect(mutual_tls_server.url, "test", connect_timeout=2)
    assert "set PLEXRL_TLS_CERT and PLEXRL_TLS_KEY" in str(refused.value)
    monkeypatch.setenv("PLEXRL_TLS_CERT", str(pki.client_cert))
    monkeypatch.setenv("PLEXRL_TLS_KEY", str(pki.client_key))
    bus = await Bus.connect(mutual_tls_server.url, "test")
    try:
        ack = await bus.publish(SUBMIT, _submit("run_mtls"), msg_id="run_mtls/1")
        assert ack.stream == "PLEXRL_RUNS"
    finally:
        await bus.close()
