"""Bad input the registry must survive: broken configs, illegal run ids, hostile directories."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from schemas import subjects as sj
from schemas.config import parse_orch_config
from schemas.events import InvalidMessage, RunConfigInvalid, RunDiscovered, RunSubmitted
from services.bus import Bus

from .conftest import RegistryFactory
from .helpers import VALID_TOML, error_reports, events_on, eventually, table, write_orch


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('env = "reverse"\nmax_steps = \n', "invalid TOML: "),
        ('envv = "reverse"\n', "envv: unknown key"),
        ("batch_size = 0\n", "batch_size: Input should be greater than or equal to 1"),
        ("[sampling]\ntop_p = 1.5\n", "sampling.top_p: Input should be less than or equal to 1"),
        (
            "[model.lora]\nrank = 32\n",
            "model.lora.rank: 32 is above this registry's limit of 16",
        ),
        ("max_async_level = 5\n", "max_async_level: 5 is above this registry's limit of 2"),
        ('env = "nope"\n', "env: unknown environment 'nope'"),
        ('env = "no_such_plexrl_plugin.envs:make"\n', "plugin module 'no_such_plexrl_plugin"),
    ],
    ids=["toml", "unknown-key", "range", "top-p", "lora-rank", "async", "env", "plugin"],
)
async def test_invalid_config_is_reported_until_the_file_is_fixed(
    make_registry: RegistryFactory, rbus: Bus, out: Path, text: str, expected: str
) -> None:
    write_orch(out, "run_bad", text)
    registry = await make_registry(max_runs=1, max_lora_rank=16, max_async_level=2)
    error_file = out / "run_bad" / "control" / "config_validation_error.txt"
    message = error_file.read_text().strip()
    assert expected in message
    [event] = await events_on(rbus, sj.INVALID, RunConfigInvalid)
    assert (event.run_id, event.error) == ("run_bad", message)
    assert registry.idx_of("run_bad") is None and registry.pool.num_free == 1  # no index used
    assert (await table(rbus))["run_bad"].status == "invalid"

    await registry.scan()  # the same file again: nothing new to say
    path = out / "run_bad" / "control" / "orch.toml"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    await registry.scan()  # touched but not changed: read again, still nothing new
    assert len(await events_on(rbus, sj.INVALID, RunConfigInvalid)) == 1

    write_orch(out, "run_bad", VALID_TOML)  # fixing the file makes the run discovered
    await registry.scan()
    [discovered] = await events_on(rbus, sj.DISCOVERED, RunDiscovered)
    assert (discovered.run_id, discovered.idx) == ("run_bad", 0)
    assert not error_file.exists()


async def test_invalid_submitted_config_is_reported_and_writes_nothing(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    await make_registry(max_lora_rank=16)
    bad = parse_orch_config(VALID_TOML).to_dict()
    bad["model"]["lora"]["rank"] = 64
    await rbus.publish(sj.SUBMIT, RunSubmitted(run_id="run_big", config=bad))
    await rbus.publish(sj.SUBMIT, RunSubmitted(run_id="run_typo", config={"bacth_size": 4}))
    events = await eventually(lambda: _at_least(rbus, 2))
    assert [(e.run_id, e.error.split(":")[0]) for e in events] == [
        ("run_big", "model.lora.rank"),
        ("run_typo", "bacth_size"),
    ]
    assert "unknown key" in events[1].error
    assert _tree(out) == []


async def _at_least(bus: Bus, n: int) -> list[RunConfigInvalid]:
    events = await events_on(bus, sj.INVALID, RunConfigInvalid)
    return events if len(events) >= n else []


ILLEGAL_NAMES = ["run_a.b", "run_*", "run_", "run_" + "x" * 196, "run_a b", "run_ä"]


async def test_illegal_directory_names_are_ignored_and_reported(
    make_registry: RegistryFactory, rbus: Bus, out: Path, tmp_path: Path
) -> None:
    for name in ILLEGAL_NAMES:
        write_orch(out, name, 'envv = "typo: would be reported in the directory"\n')
    elsewhere = tmp_path / "elsewhere"
    write_orch(elsewhere, "run_target", 'envv = "typo"\n')
    os.symlink(elsewhere / "run_target", out / "run_link")
    before_out, before_elsewhere = _tree(out), _tree(elsewhere)

    registry = await make_registry()
    await registry.scan()
    assert registry.records == {}
    assert _tree(out) == before_out and _tree(elsewhere) == before_elsewhere  # nothing written
    reports = await error_reports(rbus)
    assert len(reports) == len(ILLEGAL_NAMES) + 1  # once each, although scanned twice
    text = "\n".join(r.error for r in reports)
    for name in ILLEGAL_NAMES:
        assert repr(name if len(name) <= 80 else name[:80] + "...") in text
    assert "run_link in" in text and "symbolic link" in text
    assert await events_on(rbus, sj.DISCOVERED, RunDiscovered) == []
    # a submit cannot write through the link either
    await rbus.publish(sj.SUBMIT, RunSubmitted(run_id="run_link", config={}))
    await eventually(lambda: _reports_at_least(rbus, len(reports) + 1))
    assert "is a symbolic link" in (await error_reports(rbus))[-1].error
    assert _tree(out) == before_out and _tree(elsewhere) == before_elsewhere


async def _reports_at_least(bus: Bus, n: int) -> bool:
    return len(await error_reports(bus)) >= n


@pytest.mark.parametrize("run_id", ["run_../x", "run_a.b", "run_*", "", "run_" + "x" * 196, "x"])
async def test_illegal_run_ids_in_events_are_rejected(
    make_registry: RegistryFactory, rbus: Bus, out: Path, tmp_path: Path, run_id: str
) -> None:
    await make_registry()
    payload = json.dumps({"type": "run_submitted", "run_id": run_id, "config": {}}).encode()
    await rbus.js.publish(sj.SUBMIT, payload)
    [report] = await eventually(lambda: error_reports(rbus))
    assert isinstance(report, InvalidMessage)
    assert report.subject == sj.SUBMIT and "$.run_id" in report.error
    assert report.leading_bytes == payload[:256]
    # the registry keeps serving, and nothing was created anywhere
    await rbus.publish(sj.SUBMIT, RunSubmitted(run_id="run_ok", config={}))
    await eventually(lambda: events_on(rbus, sj.DISCOVERED, RunDiscovered))
    assert _tree(out) == ["run_ok", "run_ok/control", "run_ok/control/orch.toml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nats", "out"]


HOOK_MODULE = """
def small_batches(config):
    if config.batch_size > 4:
        return False, f"batch_size: {config.batch_size} is too big for this cluster (at most 4)"
    return True, ""


def broken(config):
    raise RuntimeError("hook bug")
"""


async def test_named_validation_hooks_are_applied(
    make_registry: RegistryFactory,
    rbus: Bus,
    out: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "plexrl_test_hooks.py").write_text(HOOK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plexrl_test_hooks", raising=False)
    write_orch(out, "run_small", VALID_TOML)
    write_orch(out, "run_big", VALID_TOML.replace("batch_size = 4", "batch_size = 8"))
    registry = await make_registry(validation_hooks=["plexrl_test_hooks:small_batches"])
    assert registry.idx_of("run_small") == 0 and registry.idx_of("run_big") is None
    [event] = await events_on(rbus, sj.INVALID, RunConfigInvalid)
    assert event.error == "batch_size: 8 is too big for this cluster (at most 4)"


async def test_a_failing_hook_rejects_the_run_and_the_registry_keeps_serving(
    make_registry: RegistryFactory,
    rbus: Bus,
    out: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "plexrl_test_hooks.py").write_text(HOOK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plexrl_test_hooks", raising=False)
    write_orch(out, "run_a")
    registry = await make_registry(validation_hooks=["plexrl_test_hooks:broken"])
    [event] = await events_on(rbus, sj.INVALID, RunConfigInvalid)
    assert event.error == "validation hook broken raised RuntimeError: hook bug"
    assert registry.pool.num_free == 4
