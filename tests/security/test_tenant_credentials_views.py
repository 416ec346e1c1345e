"""The files behind a tenant's access and what it finds in its account: seed and API key files
(where they are written, their modes, their format, the errors a broken one gives), the views
the services keep in the tenant's account (their subjects and limits on a real nats-server, the
error when its JetStream API does not answer), and the plan of ``plexrl nats-migrate`` for the
stores it moves and the ones it refuses."""

from __future__ import annotations

import asyncio
import re
import stat
import tempfile
import threading
from pathlib import Path

import nkeys
import pytest
from nats.js import api

from schemas import subjects as sj
from services.bus import Bus, EmbeddedNats
from services.tenants.accounts import tenant_js_prefix
from services.tenants.credentials import (
    CredentialsError,
    api_key_digest,
    ensure_seed,
    key_matches,
    public_key,
    seed_path,
    write_api_key,
)
from services.tenants.views import (
    RUNS_VIEW_BYTES,
    WEIGHTS_VIEW_BYTES,
    ViewsUnavailable,
    ensure_views,
)
from tests.bus.test_auth_cli import plexrl, snapshot
from tests.bus.test_follower_tenant import ACME, broker, buses  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _err_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err
    prefix = f"plexrl {command}: "
    assert err.startswith(prefix), err
    return err.removeprefix(prefix).strip()


# --- seeds and API keys ------------------------------------------------------------------------


def test_add_creates_a_missing_nested_directory_and_says_the_seed_was_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "deploy" / "secrets" / "auth"
    assert plexrl("tenants", "add", "acme", "--dir", d) == 0
    out = capsys.readouterr().out
    assert f"seed {d / 'acme.nk'} (created)" in out
    assert {"acme.nk", "acme.key", "services.nk", "tenants.toml"} <= set(snapshot(d))
    for name in ("acme.nk", "acme.key", "services.nk"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600


def test_add_writes_only_under_its_directory_whatever_the_temporary_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a TMPDIR that is gone (or on another filesystem) must not matter: the files are made
    # next to their final name and renamed into place
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", "--dir", d) == 0
    assert public_key(d / "acme.nk").startswith("U")
    assert (d / "acme.key").read_text().startswith("tml-plexrl-")
    assert not (tmp_path / "no-such-tmp").exists()


def test_an_api_key_is_the_prefix_and_43_url_safe_characters_without_padding(
    tmp_path: Path,
) -> None:
    d = tmp_path / "auth"
    keys = set()
    for name in ("acme", "beta", "gamma"):
        assert plexrl("tenants", "add", name, "--dir", d) == 0
        key = (d / f"{name}.key").read_text()
        assert key.endswith("\n")
        assert re.fullmatch(r"tml-plexrl-[A-Za-z0-9_-]{43}", key.strip()), key
        keys.add(key)
    assert len(keys) == 3


def test_a_key_matches_its_own_digest_and_no_other(tmp_path: Path) -> None:
    d = tmp_path / "auth"
    for name in ("acme", "beta"):
        assert plexrl("tenants", "add", name, "--dir", d) == 0
    acme, beta = ((d / f"{n}.key").read_text().strip() for n in ("acme", "beta"))
    assert key_matches(acme, api_key_digest(acme))
    assert key_matches(beta, api_key_digest(beta))
    assert not key_matches(acme, api_key_digest(beta))
    assert not key_matches(acme + "x", api_key_digest(acme))


def test_write_api_key_creates_its_directory_and_replaces_the_old_key(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "acme.key"
    write_api_key(path, "tml-plexrl-first")
    write_api_key(path, "tml-plexrl-second")
    assert path.read_text() == "tml-plexrl-second\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert snapshot(path.parent) == {"acme.key": b"tml-plexrl-second\n"}  # no temporary left


def test_an_api_key_that_cannot_be_written_fails_cleanly_and_leaves_no_temporary_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    (d / "acme.key").mkdir(parents=True)  # in the way of the key file
    assert plexrl("tenants", "add", "acme", "--dir", d) == 2
    assert "acme.key" in _err_line(capsys, "tenants add")
    assert not any(name.startswith(".") for name in _names(d))
    assert not (d / "tenants.toml").exists()  # the tenant was not added


def test_ensure_seed_creates_nested_directories_once_and_then_keeps_the_seed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "x" / "y" / "acme.nk"
    key, created = ensure_seed(path)
    assert created and key.startswith("U") and key == public_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_seed(path) == (key, False)
    assert snapshot(path.parent) == {"acme.nk": path.read_bytes()}  # no temporary left


def test_racing_creators_of_one_seed_all_get_it_and_only_one_made_it(tmp_path: Path) -> None:
    racers, rounds = 8, 40
    for r in range(rounds):
        path = tmp_path / f"r{r}" / "acme.nk"
        path.parent.mkdir()
        start = threading.Barrier(racers)
        results: list[tuple[str, bool] | BaseException] = []

        def race(
            path: Path = path,
            start: threading.Barrier = start,
            results: list[tuple[str, bool] | BaseException] = results,
        ) -> None:
            start.wait()
            try:
                results.append(ensure_seed(path))
            except BaseException as exc:  # reported by the assertion below
                results.append(exc)

        threads = [threading.Thread(target=race) for _ in range(racers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results.count((public_key(path), True)) == 1, results
        assert results.count((public_key(path), False)) == racers - 1, results


def test_a_seed_link_to_a_missing_file_is_reported_and_not_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "auth"
    d.mkdir()
    (d / "acme.nk").symlink_to(tmp_path / "unmounted" / "acme.nk")
    assert plexrl("tenants", "add", "acme", "--dir", d) == 2
    assert _err_line(capsys, "tenants add").startswith(f"{d / 'acme.nk'}: no such seed file")
    assert (d / "acme.nk").is_symlink() and not (tmp_path / "unmounted").exists()
    assert not any(name.startswith(".") for name in _names(d))


def test_seed_path_refuses_an_illegal_tenant_name_but_takes_the_services_names(
    tmp_path: Path,
) -> None:
    for bad in ("a.b", "../acme", "run_x"):
        with pytest.raises(ValueError, match="illegal tenant name"):
            seed_path(tmp_path, bad)
    assert seed_path(tmp_path, "services") == tmp_path / "services.nk"
    assert seed_path(tmp_path, "gateway") == tmp_path / "gateway.nk"
    assert seed_path(tmp_path, "acme") == tmp_path / "acme.nk"


def test_a_seed_that_cannot_be_read_says_which_file_and_why(tmp_path: Path) -> None:
    path = tmp_path / "acme.nk"
    path.mkdir()
    with pytest.raises(CredentialsError) as err:
        public_key(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and "Is a directory" in msg


def test_a_file_that_is_no_seed_names_the_fault_and_the_command_that_writes_seeds(
    tmp_path: Path,
) -> None:
    path = tmp_path / "acme.nk"
    path.write_text("SUnot-base32\n")
    with pytest.raises(CredentialsError) as err:
        public_key(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: not an nkey seed")
    assert "(ErrInvalidSeed)" in msg
    assert " `plexrl tenants add` " in msg


def test_an_account_seed_is_refused_as_a_user_seed(tmp_path: Path) -> None:
    path = tmp_path / "acme.nk"
    path.write_bytes(nkeys.encode_seed(bytes(32), nkeys.PREFIX_BYTE_ACCOUNT) + b"\n")
    assert path.read_text().startswith("SA")
    with pytest.raises(CredentialsError) as err:
        public_key(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and "(SU...)" in msg


# --- the views in a tenant's account -----------------------------------------------------------


async def test_a_tenants_views_hold_its_subjects_within_their_limits_and_drop_the_oldest_when_full(
    buses: tuple[Bus, Bus],  # noqa: F811
) -> None:
    _, acme = buses
    runs = (await acme.js.stream_info(sj.RUNS_STREAM)).config
    assert set(runs.subjects or []) == {sj.runs_subject(k, ACME) for k in sj.LIFECYCLE_KINDS}
    assert runs.max_bytes == RUNS_VIEW_BYTES == 16 * 1024 * 1024
    assert runs.discard == api.DiscardPolicy.OLD
    assert f"tenant {ACME}'s runs" in (runs.description or "")
    weights = (await acme.js.stream_info(sj.WEIGHTS_STREAM)).config
    assert weights.subjects == [f"plexrl.weights.{ACME}.>"]
    assert weights.max_bytes == WEIGHTS_VIEW_BYTES == 8 * 1024 * 1024
    assert weights.max_msgs_per_subject == 8
    assert weights.discard == api.DiscardPolicy.OLD
    assert f"tenant {ACME}'s runs" in (weights.description or "")


async def test_a_tenants_weights_view_keeps_the_newest_eight_announcements_of_a_run(
    buses: tuple[Bus, Bus],  # noqa: F811
) -> None:
    services, acme = buses
    subject = f"plexrl.weights.{ACME}.run_1"
    for step in range(1, 11):
        await services.nc.publish(subject, f"step {step}".encode())
    await services.nc.flush()
    for _ in range(200):  # the import delivers to acme's account asynchronously
        state = (await acme.js.stream_info(sj.WEIGHTS_STREAM)).state
        if state.last_seq == 10:
            break
        await asyncio.sleep(0.01)
    assert (state.messages, state.first_seq, state.last_seq) == (8, 3, 10)
    last = await acme.js.get_last_msg(sj.WEIGHTS_STREAM, subject)
    assert last.data == b"step 10"


async def test_views_on_a_server_without_the_tenants_account_fail_with_what_to_do(
    nats_url: str,
) -> None:
    bus = await Bus.connect(nats_url, "registry")
    try:
        with pytest.raises(ViewsUnavailable) as err:
            await ensure_views(bus.nc, ACME)
    finally:
        await bus.close()
    msg = str(err.value)
    assert msg.startswith(f"tenant {ACME}: ")
    assert "(ServiceUnavailableError)" in msg
    assert "`plexrl nats-config`" in msg


async def test_views_give_up_on_a_jetstream_api_that_never_answers(tmp_path: Path) -> None:
    # a JetStream API that is there but never answers: the caller's timeout ends the wait and
    # the error says it was a timeout
    with EmbeddedNats(store_dir=tmp_path / "nats") as server:
        bus = await Bus.connect(server.url, "registry")
        try:
            silent = await bus.nc.subscribe(f"{tenant_js_prefix(ACME)}.>")
            with pytest.raises(ViewsUnavailable, match=r"\(TimeoutError\)"):
                await ensure_views(bus.nc, ACME, timeout=0.2)
            await silent.unsubscribe()
        finally:
            await bus.close()


# --- plexrl nats-migrate -----------------------------------------------------------------------


def _store(root: Path, *dirs: str) -> Path:
    for d in dirs:
        (root / "jetstream" / d).mkdir(parents=True)
    return root


def test_migrate_moves_into_an_empty_services_account_and_lists_the_streams_sorted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path, "$G/streams/PLEXRL_RUNS", "$G/streams/KV_plexrl-registry", "PLEXRL")
    assert plexrl("nats-migrate", "--store-dir", store) == 0
    lines = capsys.readouterr().out.splitlines()
    js = store / "jetstream"
    assert lines[:3] == [
        f"moved {js / '$G'} to {js / 'PLEXRL'}: 2 streams",
        "  KV_plexrl-registry",
        "  PLEXRL_RUNS",
    ]
    assert sorted(p.name for p in js.iterdir()) == ["PLEXRL"]
    assert (js / "PLEXRL" / "streams" / "PLEXRL_RUNS").is_dir()


def test_migrate_moves_a_global_account_without_streams(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path, "$G")
    (store / "jetstream" / "$G" / "meta.inf").write_text("x")
    assert plexrl("nats-migrate", "--store-dir", store, "--dry-run") == 0
    assert capsys.readouterr().out.startswith(f"would move {store / 'jetstream' / '$G'} to ")
    assert plexrl("nats-migrate", "--store-dir", store) == 0
    assert ": 0 streams" in capsys.readouterr().out
    assert (store / "jetstream" / "PLEXRL" / "meta.inf").read_text() == "x"


def test_migrate_refusals_name_the_directories_involved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = tmp_path / "jetstream"
    source, target = js / "$G", js / "PLEXRL"
    missing = tmp_path / "none"
    assert plexrl("nats-migrate", "--store-dir", missing) == 2
    msg = _err_line(capsys, "nats-migrate")
    assert msg.startswith(f"{missing / 'jetstream'} does not exist")
    assert "--store-dir" in msg and "jetstream/" in msg.replace(str(missing), "")

    js.mkdir()
    assert plexrl("nats-migrate", "--store-dir", tmp_path) == 2
    msg = _err_line(capsys, "nats-migrate")
    assert msg.startswith(f"{source} does not exist") and str(tmp_path) in msg.removeprefix(
        str(source)
    )

    (target / "streams" / "PLEXRL_RUNS").mkdir(parents=True)
    assert plexrl("nats-migrate", "--store-dir", tmp_path) == 2
    msg = _err_line(capsys, "nats-migrate")
    assert str(target) in msg and str(source) in msg  # already moved: nothing to do

    (source / "streams").mkdir(parents=True)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert plexrl("nats-migrate", "--store-dir", tmp_path) == 2
    msg = _err_line(capsys, "nats-migrate")
    assert msg.startswith(f"{target} already holds data") and str(source) in msg
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_refused_cluster_store_points_to_a_section_of_the_deploy_guide_that_exists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path, "$G/streams", "$SYS/_js_")
    assert plexrl("nats-migrate", "--store-dir", store) == 2
    msg = _err_line(capsys, "nats-migrate")
    pointer = re.search(r"\(([\w/.]+\.md), '([^']+)'\)$", msg)
    assert pointer is not None, msg
    guide, section = pointer.groups()
    assert f"**{section}.**" in (REPO / guide).read_text()
