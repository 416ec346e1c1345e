"""``plexrl tenants add|list|remove`` and ``plexrl nats-config``: the files they write, the
server config nats-server accepts, and bad input that exits 2 and changes nothing."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest

from services.bus import Bus, free_port
from services.bus.server import find_nats_server
from services.cli import main
from services.config.tenants import TenantQuota, load_tenants
from services.tenants.credentials import api_key_digest, public_key

REPO = Path(__file__).resolve().parents[2]


def plexrl(*argv: str | Path) -> int:
    return main([str(a) for a in argv])


def refusal(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The one stderr line of a refused ``plexrl COMMAND``, without its ``plexrl COMMAND: ``."""
    err = capsys.readouterr().err
    prefix = f"plexrl {command}: "
    assert err.startswith(prefix) and err.endswith("\n"), err
    return err.removeprefix(prefix).rstrip("\n")


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())} if d.exists() else {}


def nats_server_accepts(conf: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30
    )


def test_add_writes_quotas_and_a_private_seed_then_updates_only_what_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--max-runs", "2", "--dir", d) == 0
    seed = d / "acme.nk"
    assert stat.S_IMODE(seed.stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "services.nk").stat().st_mode) == 0o600
    key = public_key(seed)
    assert key.startswith("U") and key in capsys.readouterr().out
    assert seed.read_text().startswith("SU")

    assert plexrl("tenants", "add", "acme", "--max-lora-rank", "8", "--dir", d) == 0
    quota = load_tenants(d / "tenants.toml").quota("acme")
    assert quota.model_copy(update={"api_key_sha256": None}) == TenantQuota(
        max_runs=2, max_lora_rank=8
    )
    assert public_key(seed) == key  # the seed is kept
    assert "(kept)" in capsys.readouterr().out


def test_add_gives_a_new_tenant_an_api_key_shown_once_and_stores_only_its_digest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--dir", d) == 0
    key_file = d / "acme.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_text().strip()
    assert key.startswith("tml-") and len(key) > 40
    assert key in capsys.readouterr().out  # shown once...
    assert plexrl("tenants", "add", "acme", "--max-runs", "1", "--dir", d) == 0
    assert key not in capsys.readouterr().out  # ...and not again
    stored = (d / "tenants.toml").read_text()
    assert key not in stored and api_key_digest(key) in stored
    assert plexrl("tenants", "add", "acme", "--rotate-key", "--dir", d) == 0
    rotated = key_file.read_text().strip()
    assert rotated != key and rotated in capsys.readouterr().out
    assert load_tenants(d / "tenants.toml").quota("acme").api_key_sha256 == api_key_digest(rotated)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["services"], "reserved"),
        (["default"], "reserved"),
        (["gateway"], "reserved"),
        (["run_x"], "illegal tenant name"),
        (["a.b"], "illegal tenant name"),
        (["acme", "--max-runs", "-1"], "max_runs"),
        (["acme", "--max-lora-rank", "0"], "max_lora_rank"),
    ],
)
def test_add_rejects_bad_input_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", *argv, "--dir", d) == 2
    err = refusal(capsys, "tenants add")
    assert message in err
    if "--max-runs" not in argv and "--max-lora-rank" not in argv:
        assert f"'{argv[0]}'" in err  # the refused name
    assert snapshot(d) == {}


def test_add_keeps_everything_when_the_tenants_file_or_a_seed_is_broken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    d.mkdir()
    (d / "tenants.toml").write_text("[tenants.acme]\nmax_runz = 1\n")
    before = snapshot(d)
    assert plexrl("tenants", "add", "beta", "--dir", d) == 2
    assert "max_runz" in capsys.readouterr().err
    assert snapshot(d) == before

    (d / "tenants.toml").unlink()
    (d / "beta.nk").write_text("not a seed\n")
    before = snapshot(d)
    assert plexrl("tenants", "add", "beta", "--dir", d) == 2
    assert f"{d / 'beta.nk'}: not an nkey seed" in refusal(capsys, "tenants add")
    assert snapshot(d) == before


def test_list_and_remove(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "list", "--dir", d) == 0
    assert "no tenants" in capsys.readouterr().out
    for name in ("acme", "beta"):
        assert plexrl("tenants", "add", name, "--max-runs", "3", "--dir", d) == 0
    capsys.readouterr()
    assert plexrl("tenants", "list", "--dir", d) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"acme\tmax_runs 3\t{public_key(d / 'acme.nk')}\tAPI key set",
        f"beta\tmax_runs 3\t{public_key(d / 'beta.nk')}\tAPI key set",
    ]

    before = snapshot(d)
    assert plexrl("tenants", "remove", "gamma", "--dir", d) == 2
    assert "no tenant 'gamma'" in capsys.readouterr().err
    assert snapshot(d) == before

    assert plexrl("tenants", "remove", "acme", "--dir", d) == 0
    assert set(load_tenants(d / "tenants.toml").tenants) == {"beta"}
    assert not (d / "acme.nk").exists() and not (d / "acme.key").exists()
    assert (d / "beta.nk").exists() and (d / "beta.key").exists()


def test_nats_config_holds_public_keys_and_an_account_per_tenant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    for name in ("acme", "beta"):
        assert plexrl("tenants", "add", name, "--max-store-bytes", "100000000", "--dir", d) == 0
    assert plexrl("nats-config", "--dir", d, "--store-dir", tmp_path / "js") == 0
    conf = d / "nats.conf"
    text = conf.read_text()
    for name in ("acme", "beta", "services", "gateway"):
        assert public_key(d / f"{name}.nk") in text
        assert (d / f"{name}.nk").read_text().strip() not in text  # never a seed
        if name in ("acme", "beta"):
            assert (d / f"{name}.key").read_text().strip() not in text  # nor an API key
            # each account's imports and exports, against lists written out by hand:
            # tests/security/test_nats_config_render.py
            assert f'"TENANT_{name}": {{' in text
    assert text.count("max_file: 100000000") == 2
    result = nats_server_accepts(conf)
    assert result.returncode == 0, result.stderr


def test_nats_config_from_the_deploy_base_with_tls(tmp_path: Path) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "team-a", "--dir", d) == 0
    out = tmp_path / "nats.conf"
    base = REPO / "deploy" / "nats.conf"
    tls = ["--tls-cert", "/certs/server.pem", "--tls-key", "/certs/key.pem"]
    assert plexrl("nats-config", "--dir", d, "--base", base, "--out", out, *tls) == 0
    text = out.read_text()
    assert base.read_text() in text
    assert 'cert_file: "/certs/server.pem"' in text
    assert "verify" not in text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-cert", "c.pem"], "together"),
        (["--tls-key", "k.pem"], "together"),
        (["--tls-ca", "ca.pem"], "need --tls-cert"),
        (["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-verify"], "needs --tls-ca"),
        (["--base", "/nonexistent/nats.conf"], "/nonexistent/nats.conf"),
    ],
)
def test_nats_config_rejects_bad_flags_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--dir", d) == 0
    before = snapshot(d)
    assert plexrl("nats-config", "--dir", d, *flags) == 2
    assert message in capsys.readouterr().err
    assert snapshot(d) == before


def test_nats_config_needs_every_tenants_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--dir", d) == 0
    (d / "acme.nk").unlink()
    before = snapshot(d)
    assert plexrl("nats-config", "--dir", d) == 2
    err = capsys.readouterr().err
    assert "acme.nk: no such seed file" in err and "plexrl tenants add" in err
    assert snapshot(d) == before


async def test_a_server_started_with_the_generated_config_lets_the_services_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--dir", d) == 0
    port = free_port()
    listen = f"127.0.0.1:{port}"
    assert plexrl("nats-config", "--dir", d, "--listen", listen, "--store-dir", tmp_path) == 0
    proc = subprocess.Popen(
        [find_nats_server(), "-c", str(d / "nats.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(500):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.02)
        monkeypatch.setenv("PLEXRL_NATS_CREDS", str(d / "services.nk"))
        bus = await Bus.connect(f"nats://{listen}", "registry")
        try:
            assert bus.nc._server_info["max_payload"] == 8 * 1024 * 1024
            assert (await bus.js.account_info()).streams >= 4
        finally:
            await bus.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert os.path.isdir(tmp_path / "jetstream")
