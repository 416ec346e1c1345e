"""``plexrl registry``, ``submit``, ``evict`` and ``runs``: exit codes, messages and output."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from schemas.records import Progress
from services.bus import Bus, EmbeddedNats, free_port
from services.cli import main
from services.runs.progress import write_progress

from .conftest import RegistryFactory
from .helpers import VALID_TOML, eventually, table


def _config(tmp_path: Path, text: str = VALID_TOML, name: str = "orch.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("run_id", ["run_a.b", "run_../x", "run_*", "", "run_" + "x" * 196])
def test_submit_refuses_an_illegal_run_id_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], run_id: str
) -> None:
    # no server at this address: the check must come first
    url = f"nats://127.0.0.1:{free_port()}"
    assert main(["submit", run_id, str(_config(tmp_path)), "--nats-url", url]) == 2
    assert "illegal run id" in capsys.readouterr().err


def test_submit_refuses_an_invalid_config_with_the_precise_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, 'envv = "reverse"\n[optim]\nlr = 5.0\n')
    assert main(["submit", "run_ok", str(config)]) == 2
    err = capsys.readouterr().err
    assert "envv: unknown key" in err and "optim.lr: Input should be less than or equal to 1" in err
    assert main(["submit", "run_ok", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["submit", "run_a", "CONFIG"],
        ["evict", "run_a", "--reason", "r"],
        ["runs"],
        ["registry", "--output-dir", "OUT", "--max-runs", "2"],
    ],
    ids=["submit", "evict", "runs", "registry"],
)
def test_every_command_says_when_nats_is_unreachable(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
) -> None:
    # the registry, a service, waits PLEXRL_CONNECT_WAIT_S for its first connection: not here
    monkeypatch.setenv("PLEXRL_CONNECT_WAIT_S", "0")
    port = free_port()
    argv = [str(_config(tmp_path)) if a == "CONFIG" else a for a in argv]
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert main([*argv, "--nats-url", f"nats://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach NATS at nats://127.0.0.1:{port}" in err and "PLEXRL_NATS_URL" in err


def test_registry_settings_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["registry", "--output-dir", str(tmp_path), "--max-runs", "0"]) == 2
    assert "max_runs: Input should be greater than or equal to 1" in capsys.readouterr().err
    argv = ["registry", "--output-dir", str(tmp_path), "--validation-hook", "nope_mod:check"]
    assert main(argv) == 2
    assert "cannot import 'nope_mod'" in capsys.readouterr().err
    bad = tmp_path / "tenants.toml"
    bad.write_text("[tenants.team-a]\nmax_lora_rank = 0\n")
    assert main(["registry", "--output-dir", str(tmp_path), "--tenants-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "tenants.team-a.max_lora_rank" in err


async def test_submit_wait_runs_and_evict_against_a_registry(
    make_registry: RegistryFactory,
    server: EmbeddedNats,
    rbus: Bus,
    tmp_path: Path,
    out: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await make_registry(max_lora_rank=16)
    nats = ["--nats-url", server.url]

    def cli(*argv: str) -> asyncio.Future[int]:
        # in a thread: the command runs its own event loop while ours serves the registry
        return asyncio.ensure_future(asyncio.to_thread(main, [*argv, *nats]))

    assert await cli("submit", "run_cli", str(_config(tmp_path)), "--wait", "10") == 0
    assert "run_cli is running with index 0" in capsys.readouterr().out
    other = _config(tmp_path, VALID_TOML.replace("max_steps = 20", "max_steps = 30"), "o.toml")
    assert await cli("submit", "run_cli", str(other), "--wait", "10") == 1
    assert "run_cli already exists with a different config" in capsys.readouterr().err

    big = _config(tmp_path, VALID_TOML.replace("rank = 8", "rank = 32"), "big.toml")
    assert await cli("submit", "run_big", str(big), "--wait", "10") == 1
    assert "rejected run_big: model.lora.rank: 32 is above" in capsys.readouterr().err

    await write_progress(rbus, "run_cli", Progress(step=4, total_tokens=1234, total_samples=64))
    assert await cli("runs") == 0
    shown = capsys.readouterr().out
    assert "run_cli" in shown and "active" in shown and "1,234" in shown
    assert await cli("runs", "--json") == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row == {
        "run_id": "run_cli",
        "tenant": "default",
        "idx": 0,
        "status": "active",
        "step": 4,
        "total_tokens": 1234,
        "total_samples": 64,
        "reward_mean": None,
        "detail": "",
    }

    assert await cli("evict", "run_cli", "--reason", "finished early") == 0
    await eventually(lambda: _status(rbus, "run_cli", "evicted"))
    assert (out / "run_cli" / "control" / "evicted.txt").read_text() == "finished early\n"
    assert capsys.readouterr().out == "asked the registry to evict run_cli: finished early\n"

    assert await cli("evict", "run_ghost", "--reason", "typo") == 0
    assert "note: run_ghost is not in the run table" in capsys.readouterr().err


async def _status(bus: Bus, run_id: str, status: str) -> bool:
    records = await table(bus)
    return run_id in records and records[run_id].status == status


async def test_a_tenant_submits_lists_and_evicts_through_its_own_subjects(
    make_registry: RegistryFactory,
    server: EmbeddedNats,
    rbus: Bus,
    tmp_path: Path,
    out: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from schemas.events import RunDiscovered
    from services.config.tenants import TenantQuota, TenantsFile, save_tenants

    from .helpers import events_on, write_orch

    tenants = tmp_path / "tenants.toml"
    save_tenants(tenants, TenantsFile(tenants={"team-a": TenantQuota(max_lora_rank=8)}))
    write_orch(out, "run_operator")
    await make_registry(tenants_file=tenants)
    monkeypatch.setenv("PLEXRL_TENANT", "team-a")
    nats = ["--nats-url", server.url]

    def cli(*argv: str) -> asyncio.Future[int]:
        return asyncio.ensure_future(asyncio.to_thread(main, [*argv, *nats]))

    assert await cli("submit", "run_t", str(_config(tmp_path)), "--wait", "10") == 0
    assert "run_t is running with index 1" in capsys.readouterr().out
    [event] = await events_on(rbus, "plexrl.runs.team-a.discovered", RunDiscovered)
    assert (event.run_id, event.tenant) == ("run_t", "team-a")
    # The same id with another config: the registry keeps the first. A tenant cannot read the
    # registry's error reports, so its row's digest is what tells the CLI (it used to say
    # "running").
    other = _config(tmp_path, VALID_TOML.replace("max_steps = 20", "max_steps = 30"), "o.toml")
    assert await cli("submit", "run_t", str(other), "--wait", "10") == 1
    err = capsys.readouterr().err
    assert f"run_t already exists with a different config (registry: {event.config_digest}" in err
    assert await cli("submit", "run_t", str(_config(tmp_path)), "--wait", "10") == 0
    assert "run_t is running with index 1" in capsys.readouterr().out

    big = _config(tmp_path, VALID_TOML.replace("rank = 8", "rank = 16"), "big.toml")
    assert await cli("submit", "run_big", str(big), "--wait", "10") == 1
    assert "quota max_lora_rank = 8: the run asks for rank 16" in capsys.readouterr().err

    assert await cli("runs", "--json") == 0  # only its own runs, through the list service
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["run_id"], r["tenant"], r["idx"], r["status"]) for r in rows] == [
        ("run_t", "team-a", 1, "active")
    ]
    assert await cli("runs") == 0
    assert "team-a" in capsys.readouterr().out

    assert await cli("evict", "run_operator", "--reason", "not mine") == 0  # refused
    assert "note: run_operator is not in the run table" in capsys.readouterr().err
    assert await cli("evict", "run_t", "--reason", "done") == 0
    await eventually(lambda: _status(rbus, "run_t", "evicted"))
    assert (await table(rbus))["run_operator"].status == "active"
