"""The argument parsing of ``plexrl tenants add|list|remove``, ``plexrl nats-config`` and
``plexrl nats-migrate``: the names a user reads in usage lines and errors, the values and types
each flag parses to, the defaults a command falls back to, and the quotas ``tenants list``
shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import build_parser
from services.config.tenants import load_tenants
from services.tenants.credentials import public_key
from tests.bus.test_auth_cli import plexrl

QUOTA_FLAGS = {
    "--max-runs": "max_runs",
    "--max-waiting": "max_waiting",
    "--max-lora-rank": "max_lora_rank",
    "--max-samples-per-step": "max_samples_per_step",
    "--max-run-dirs": "max_run_dirs",
    "--max-connections": "max_connections",
    "--max-subscriptions": "max_subscriptions",
    "--max-payload": "max_payload",
    "--max-store-bytes": "max_store_bytes",
    "--max-memory-bytes": "max_memory_bytes",
    "--max-streams": "max_streams",
    "--max-consumers": "max_consumers",
}


def usage(text: str) -> str:
    """The usage paragraph of a help or error text, on one line."""
    return " ".join(text.split("\n\n")[0].split())


def exit_status(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run a command that argparse ends (help, a usage error): its status, stdout, stderr."""
    with pytest.raises(SystemExit) as exc:
        plexrl(*argv)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_tenants_without_a_subcommand_prints_its_own_help_and_succeeds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert plexrl("tenants") == 0
    out = capsys.readouterr().out
    assert usage(out) == "usage: plexrl tenants [-h] SUBCOMMAND ..."
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ")}
    assert listed == {"add", "list", "remove"}


def test_add_and_remove_name_their_missing_argument_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in ("add", "remove"):
        status, _, err = exit_status(capsys, "tenants", command)
        assert status == 2
        assert usage(err).startswith(f"usage: plexrl tenants {command} [-h]")
        assert usage(err).endswith(" NAME")
        assert "the following arguments are required: NAME" in err


def test_usage_lines_show_what_each_flag_takes(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = exit_status(capsys, "tenants", "add", "--help")
    assert status == 0
    line = usage(out)
    for flag in QUOTA_FLAGS:
        assert f"[{flag} N]" in line
    assert "[--rotate-key] [--dir DIR] NAME" in line

    status, out, _ = exit_status(capsys, "tenants", "remove", "--help")
    assert (status, usage(out)) == (0, "usage: plexrl tenants remove [-h] [--dir DIR] NAME")

    status, out, _ = exit_status(capsys, "nats-config", "--help")
    assert status == 0
    line = usage(out)
    for shown in ("[--dir DIR]", "[--out OUT]", "[--base FILE]", "[--listen LISTEN]"):
        assert shown in line
    # the defaults a user would otherwise have to look up in the code
    flat = " ".join(out.split())
    assert "0.0.0.0:4222" in flat and "plexrl-jetstream" in flat and "./plexrl-auth" in flat


def test_add_parses_every_quota_flag_to_an_integer_and_defaults_the_rest() -> None:
    argv = ["tenants", "add", "acme"]
    for i, flag in enumerate(QUOTA_FLAGS, start=1):
        argv += [flag, str(i)]
    args = build_parser().parse_args(argv)
    assert (args.command, args.tenants_command, args.name) == ("tenants", "add", "acme")
    for i, dest in enumerate(QUOTA_FLAGS.values(), start=1):
        assert getattr(args, dest) == i and type(getattr(args, dest)) is int
    assert args.rotate_key is False
    assert args.dir == Path("plexrl-auth")

    args = build_parser().parse_args(["tenants", "add", "acme", "--rotate-key", "--dir", "d"])
    assert all(getattr(args, dest) is None for dest in QUOTA_FLAGS.values())
    assert (args.rotate_key, args.dir) == (True, Path("d"))


@pytest.mark.parametrize("command", ["list", "remove"])
def test_list_and_remove_parse_their_subcommand_and_directory(command: str) -> None:
    extra = ["acme"] if command == "remove" else []
    args = build_parser().parse_args(["tenants", command, *extra, "--dir", "auth"])
    assert args.tenants_command == command
    assert args.dir == Path("auth") and isinstance(args.dir, Path)


def test_a_quota_that_is_not_an_integer_is_a_usage_error_that_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    status, _, err = exit_status(capsys, "tenants", "add", "acme", "--max-runs", "2x", "--dir", d)
    assert status == 2
    assert "--max-runs" in err and "invalid int value: '2x'" in err
    assert not d.exists()


def test_without_dir_the_tenants_live_in_plexrl_auth_of_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert plexrl("tenants", "add", "acme") == 0
    assert "plexrl-auth/tenants.toml" in capsys.readouterr().out
    assert set(load_tenants(tmp_path / "plexrl-auth" / "tenants.toml").tenants) == {"acme"}
    assert (tmp_path / "plexrl-auth" / "acme.nk").is_file()
    assert plexrl("tenants", "list") == 0
    assert capsys.readouterr().out.startswith("acme\t")


def test_list_shows_the_quotas_a_tenant_has_set_or_that_it_has_the_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    assert (
        plexrl("tenants", "add", "acme", "--max-runs", "3", "--max-waiting", "4", "--dir", d) == 0
    )
    assert "tenant acme: max_runs 3, max_waiting 4; written to" in capsys.readouterr().out
    assert plexrl("tenants", "add", "beta", "--dir", d) == 0
    assert "tenant beta: default quotas; written to" in capsys.readouterr().out
    assert plexrl("tenants", "list", "--dir", d) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"acme\tmax_runs 3, max_waiting 4\t{public_key(d / 'acme.nk')}\tAPI key set",
        f"beta\tdefault quotas\t{public_key(d / 'beta.nk')}\tAPI key set",
    ]


def test_nats_config_defaults_to_listening_on_4222_with_jetstream_in_plexrl_jetstream(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--dir", d) == 0
    capsys.readouterr()
    assert plexrl("nats-config", "--dir", d, "--out", "-") == 0
    text = capsys.readouterr().out
    assert 'listen: "0.0.0.0:4222"\n' in text
    assert 'store_dir: "plexrl-jetstream"\n' in text
    assert not (d / "nats.conf").exists()


def test_nats_config_parses_its_file_flags_to_paths() -> None:
    args = build_parser().parse_args(["nats-config"])
    assert (args.out, args.base, args.tls_cert, args.tls_key, args.tls_ca) == (None,) * 5
    assert (args.listen, args.tls_verify) == ("0.0.0.0:4222", False)
    assert args.store_dir == Path("plexrl-jetstream") and args.dir == Path("plexrl-auth")

    flags = {
        "--dir": "dir",
        "--out": "out",
        "--base": "base",
        "--store-dir": "store_dir",
        "--tls-cert": "tls_cert",
        "--tls-key": "tls_key",
        "--tls-ca": "tls_ca",
    }
    argv = ["nats-config", "--listen", "127.0.0.1:5000", "--tls-verify"]
    for flag, dest in flags.items():
        argv += [flag, f"/x/{dest}"]
    args = build_parser().parse_args(argv)
    assert (args.listen, args.tls_verify) == ("127.0.0.1:5000", True)
    for dest in flags.values():
        value = getattr(args, dest)
        assert value == Path(f"/x/{dest}") and isinstance(value, Path), dest


def test_nats_migrate_requires_the_store_dir_and_parses_it_to_a_path(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, _, err = exit_status(capsys, "nats-migrate")
    assert status == 2
    assert "the following arguments are required: --store-dir" in err

    args = build_parser().parse_args(["nats-migrate", "--store-dir", "js", "--dry-run"])
    assert args.store_dir == Path("js") and isinstance(args.store_dir, Path)
    assert args.dry_run is True
    assert build_parser().parse_args(["nats-migrate", "--store-dir", "js"]).dry_run is False
