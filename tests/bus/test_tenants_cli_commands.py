"""What ``plexrl tenants add|list|remove``, ``plexrl nats-config`` and ``plexrl nats-migrate``
tell their user: each refusal names its command on stderr, exits 2 and changes nothing; each
success prints the paths it wrote, the keys it made and the command to run next; the API key
file is written only when there is a new key; a tenant whose files are gone can still be listed
and removed; ``--out -`` and the TLS flags reach the config; and a migration says what it moved
(or would move)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config.tenants import load_tenants
from services.tenants.credentials import public_key
from tests.bus.test_auth_cli import plexrl, refusal, snapshot

# tenants add


def test_add_prints_the_tenants_file_its_seed_key_file_and_what_to_do_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--max-runs", "2", "--dir", d) == 0
    seed, key_file = d / "acme.nk", d / "acme.key"
    summary, seed_line, key_line, next_line = capsys.readouterr().out.splitlines()
    assert summary.startswith("tenant acme: max_runs 2;")
    assert summary.endswith(f"written to {d / 'tenants.toml'}")
    assert seed_line.startswith(f"  seed {seed} (created)")
    assert seed_line.endswith(public_key(seed))
    assert str(key_file) in key_line and key_line.endswith(key_file.read_text().strip())
    assert next_line.startswith(f"  next: plexrl nats-config --dir {d},")
    assert str(seed) in next_line and next_line.endswith("acme")


def test_adding_again_keeps_the_seed_and_the_api_key_file_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--dir", d) == 0
    key = (d / "acme.key").read_text()
    capsys.readouterr()
    assert plexrl("tenants", "add", "acme", "--max-runs", "4", "--dir", d) == 0
    out = capsys.readouterr().out.splitlines()
    assert (d / "acme.key").read_text() == key  # no new key, so the file is not rewritten
    assert len(out) == 3 and not any("API key" in line and "acme.key" in line for line in out)
    assert out[1].startswith(f"  seed {d / 'acme.nk'} (kept)")
    assert load_tenants(d / "tenants.toml").quota("acme").max_runs == 4


# tenants list


def test_list_says_which_tenant_has_no_api_key_and_which_has_no_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    d.mkdir()
    # a tenants file written by hand (or before API keys): no key digest, no seed files
    (d / "tenants.toml").write_text("[tenants.acme]\nmax_runs = 1\n")
    assert plexrl("tenants", "list", "--dir", d) == 0
    (line,) = capsys.readouterr().out.splitlines()
    name, limits, key, has_key = line.split("\t")
    assert (name, limits, has_key) == ("acme", "max_runs 1", "no API key")
    assert key.startswith("(no usable seed: ") and "acme.nk" in key


@pytest.mark.parametrize("command", ["list", "remove"])
def test_list_and_remove_refuse_a_broken_tenants_file_and_say_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    d = tmp_path / "auth"
    d.mkdir()
    (d / "tenants.toml").write_text("[tenants.acme]\nmax_runz = 1\n")
    before = snapshot(d)
    argv = ["tenants", command, *(["acme"] if command == "remove" else []), "--dir", d]
    assert plexrl(*argv) == 2
    assert "max_runz" in refusal(capsys, f"tenants {command}")
    assert snapshot(d) == before


# tenants remove


def test_remove_of_an_unknown_tenant_names_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "remove", "gamma", "--dir", d) == 2
    assert refusal(capsys, "tenants remove").endswith("(tenants: none)")
    for name in ("beta", "acme"):
        assert plexrl("tenants", "add", name, "--dir", d) == 0
    capsys.readouterr()
    before = snapshot(d)
    assert plexrl("tenants", "remove", "gamma", "--dir", d) == 2
    message = refusal(capsys, "tenants remove")
    assert "'gamma'" in message and str(d / "tenants.toml") in message
    assert message.endswith("(tenants: acme, beta)")
    assert snapshot(d) == before


def test_remove_drops_a_tenant_whose_files_are_already_gone_and_says_what_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    d.mkdir()
    (d / "tenants.toml").write_text("[tenants.acme]\nmax_runs = 1\n[tenants.beta]\n")
    assert plexrl("tenants", "remove", "acme", "--dir", d) == 0
    assert set(load_tenants(d / "tenants.toml").tenants) == {"beta"}
    removed, next_line = capsys.readouterr().out.splitlines()
    assert removed.startswith(f"removed tenant acme from {d / 'tenants.toml'}")
    assert next_line.startswith(f"  next: plexrl nats-config --dir {d} ")
    assert next_line.endswith("credentials")  # what the reload does: revoke them


# nats-config


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--tls-cert", "c.pem"], "give --tls-cert and --tls-key"),
        (["--tls-ca", "ca.pem"], "--tls-ca and --tls-verify need --tls-cert and --tls-key"),
        (["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-verify"], "--tls-verify needs"),
    ],
)
def test_nats_config_refuses_incomplete_tls_flags_naming_the_flags_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], names: str
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--dir", d) == 0
    capsys.readouterr()
    before = snapshot(d)
    assert plexrl("nats-config", "--dir", d, *flags) == 2
    assert refusal(capsys, "nats-config").startswith(names)
    assert snapshot(d) == before


def test_nats_config_refuses_a_missing_seed_or_base_naming_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--dir", d) == 0
    capsys.readouterr()
    missing = tmp_path / "missing.conf"
    assert plexrl("nats-config", "--dir", d, "--base", missing) == 2
    assert str(missing) in refusal(capsys, "nats-config")
    (d / "acme.nk").unlink()
    before = snapshot(d)
    assert plexrl("nats-config", "--dir", d) == 2
    message = refusal(capsys, "nats-config")
    assert "acme.nk" in message and "plexrl tenants add" in message
    assert snapshot(d) == before


def test_nats_config_writes_mutual_tls_with_every_path_given(tmp_path: Path) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--dir", d) == 0
    tls = ["--tls-cert", "/certs/s.pem", "--tls-key", "/certs/k.pem", "--tls-ca", "/certs/ca.pem"]
    assert plexrl("nats-config", "--dir", d, *tls, "--tls-verify") == 0
    text = (d / "nats.conf").read_text()
    block = text[text.index("tls {") :].split("}", 1)[0].splitlines()[1:]
    assert [line.strip() for line in block] == [
        'cert_file: "/certs/s.pem"',
        'key_file: "/certs/k.pem"',
        'ca_file: "/certs/ca.pem"',
        "verify: true",
    ]


def test_nats_config_to_stdout_prints_the_config_and_writes_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--dir", d) == 0
    assert plexrl("nats-config", "--dir", d, "--out", tmp_path / "nats.conf") == 0
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    assert plexrl("nats-config", "--dir", d, "--out", "-") == 0
    assert capsys.readouterr().out == (tmp_path / "nats.conf").read_text()
    assert not (tmp_path / "-").exists() and not (d / "nats.conf").exists()


def test_nats_config_says_where_it_wrote_and_which_tenants_have_accounts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    for name in ("beta", "acme"):
        assert plexrl("tenants", "add", name, "--dir", d) == 0
    capsys.readouterr()
    out = tmp_path / "conf" / "nats.conf"
    assert plexrl("nats-config", "--dir", d, "--out", out) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"wrote {out}: ")
    assert "2 tenant account(s) acme, beta;" in line
    assert "services" not in line.split(";")[0].split("account(s)")[1]
    assert "nats-server --signal reload" in line


# nats-migrate


def _single_account_store(root: Path) -> Path:
    for stream in ("PLEXRL_RUNS", "KV_plexrl-registry"):
        (root / "jetstream" / "$G" / "streams" / stream).mkdir(parents=True)
    return root


def test_migrate_dry_run_says_what_would_move_and_moves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _single_account_store(tmp_path / "store")
    assert plexrl("nats-migrate", "--store-dir", store, "--dry-run") == 0
    js = store / "jetstream"
    assert capsys.readouterr().out.splitlines() == [
        f"would move {js / '$G'} to {js / 'PLEXRL'}: 2 streams",
        "  KV_plexrl-registry",
        "  PLEXRL_RUNS",
    ]
    assert (js / "$G").is_dir() and not (js / "PLEXRL").exists()


def test_migrate_says_what_it_moved_and_to_start_the_server_on_the_new_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _single_account_store(tmp_path / "store")
    assert plexrl("nats-migrate", "--store-dir", store) == 0
    js = store / "jetstream"
    moved, *streams, next_line = capsys.readouterr().out.splitlines()
    assert moved == f"moved {js / '$G'} to {js / 'PLEXRL'}: 2 streams"
    assert streams == ["  KV_plexrl-registry", "  PLEXRL_RUNS"]
    assert next_line.startswith("  next: start the server")
    assert next_line.endswith("`plexrl nats-config`")
    assert (js / "PLEXRL" / "streams" / "PLEXRL_RUNS").is_dir() and not (js / "$G").exists()


def test_migrate_refuses_a_missing_store_naming_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plexrl("nats-migrate", "--store-dir", tmp_path / "none") == 2
    assert str(tmp_path / "none" / "jetstream") in refusal(capsys, "nats-migrate")
    assert not (tmp_path / "none").exists()
