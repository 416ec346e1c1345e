"""Upgrading a single-account deployment to accounts keeps its runs: ``plexrl nats-migrate``
moves the store, and the registry, started again on the accounts of ``plexrl nats-config``,
holds every run with the index, config and stream sequences it had."""

from __future__ import annotations

from pathlib import Path

import pytest
from accounts_support import write_auth, write_config
from victim_support import COMMANDS_RUN, eventually, status_of, submit

from schemas import subjects as sj
from services.bus import Bus, EmbeddedNats, free_port
from services.cli import main
from services.config import process_settings
from services.config.tenants import TenantQuota
from services.registry.service import Registry
from services.registry.settings import RegistrySettings
from services.tenants.credentials import seed_path


async def _registry(bus: Bus, out: Path, tenants_file: Path | None = None) -> Registry:
    registry = Registry(bus, RegistrySettings(output_dir=out, tenants_file=tenants_file))
    await registry.start()
    return registry


async def test_a_single_account_deployment_moves_to_accounts_with_its_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, out, port = tmp_path / "store", tmp_path / "out", free_port()
    # before: one account, as plexrl was deployed before tenants had accounts
    with EmbeddedNats(store_dir=store, port=port) as old:
        bus = await Bus.connect(old.url, "registry")
        registry = await _registry(bus, out)
        await submit(bus, "default", "run_kept", COMMANDS_RUN)
        await eventually(lambda: _active(registry, "run_kept"))
        # the table is written before its event is published, and marked once it is
        await eventually(lambda: _published(registry, "run_kept"))
        before = await bus.js.get_last_msg(sj.RUNS_STREAM, sj.DISCOVERED)
        record = registry.records["run_kept"]
        await registry.stop()
        await bus.close()

    assert main(["nats-migrate", "--store-dir", str(store), "--dry-run"]) == 0
    assert "would move" in capsys.readouterr().out and (store / "jetstream" / "$G").is_dir()
    assert main(["nats-migrate", "--store-dir", str(store)]) == 0
    moved = capsys.readouterr().out
    assert "PLEXRL_RUNS" in moved and "KV_plexrl-registry" in moved
    assert main(["nats-migrate", "--store-dir", str(store)]) == 2  # nothing left to move

    # after: the accounts of plexrl tenants add / nats-config on the same store
    auth = tmp_path / "auth"
    write_auth(auth, {"acme": TenantQuota()})
    conf = write_config(auth, port, store)
    with EmbeddedNats(store_dir=tmp_path / "log", port=port, config=conf) as new:
        identity = process_settings(nats_creds=str(seed_path(auth, "services")))
        bus = await Bus.connect(new.url, "registry", settings=identity)
        registry = await _registry(bus, out, auth / "tenants.toml")
        try:
            kept = registry.records["run_kept"]
            assert (kept.status, kept.idx, kept.config_digest) == (
                "active",
                record.idx,
                record.config_digest,
            )
            after = await bus.js.get_last_msg(sj.RUNS_STREAM, sj.DISCOVERED)
            assert (after.seq, after.data) == (before.seq, before.data)  # incarnations hold
            acme = await Bus.connect(
                new.url,
                "cli",
                settings=process_settings(nats_creds=str(seed_path(auth, "acme")), tenant="acme"),
            )
            try:
                await submit(acme, "acme", "run_new", COMMANDS_RUN)
                await eventually(lambda: _acme_active(acme))
            finally:
                await acme.close()
        finally:
            await registry.stop()
            await bus.close()


def test_a_clustered_or_missing_store_is_refused_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["nats-migrate", "--store-dir", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "jetstream" / "$G" / "streams").mkdir(parents=True)
    (tmp_path / "jetstream" / "$SYS" / "_js_").mkdir(parents=True)
    assert main(["nats-migrate", "--store-dir", str(tmp_path)]) == 2
    assert "cluster" in capsys.readouterr().err
    assert (tmp_path / "jetstream" / "$G").is_dir()


async def _active(registry: Registry, run_id: str) -> bool:
    rec = registry.records.get(run_id)
    return rec is not None and rec.status == "active"


async def _published(registry: Registry, run_id: str) -> bool:
    return bool(registry.records[run_id].last_published)


async def _acme_active(acme: Bus) -> bool:
    return await status_of(acme, "acme", "run_new") == "active"
