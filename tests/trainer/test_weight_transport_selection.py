"""Choosing the weight transport: the settings, a clear start-up error where the machine cannot
run the chosen one, and a trainer that announces its adapters over ``ucx``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from service_support import Cluster, eventually, publish_batch, submit, weights_events
from trainer_support import make_batch, run_config, same_tensors

from services.bus import Bus
from services.config import SettingsError, load_settings
from services.trainer.service import build_publisher
from services.trainer.settings import TrainerSettings
from services.weights import load_weights, unavailable_reason
from services.weights.errors import TransportUnavailable

REPO = Path(__file__).parents[2]


def _cli(prelude: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``plexrl`` in a fresh interpreter after ``prelude`` (which can take a module away)."""
    code = f"import sys\n{prelude}\nfrom services.cli import main\nsys.exit(main({list(args)!r}))\n"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_the_direct_transports_and_their_addresses_come_from_the_environment():
    env = {
        "PLEXRL_WEIGHT_TRANSPORT": "ucx",
        "PLEXRL_UCX_HOST": "10.0.0.5",
        "PLEXRL_UCX_PORT": "7000",
        "PLEXRL_COLLECTIVE_HOST": "10.0.0.6",
        "PLEXRL_COLLECTIVE_PORT": "29999",
        "PLEXRL_COLLECTIVE_BUCKET_BYTES": "1048576",
    }
    settings = load_settings(TrainerSettings, None, {"model": "m"}, environ=env)
    assert (settings.weight_transport, settings.ucx_host, settings.ucx_port) == (
        "ucx",
        "10.0.0.5",
        7000,
    )
    assert (
        settings.collective_host,
        settings.collective_port,
        settings.collective_bucket_bytes,
    ) == ("10.0.0.6", 29999, 1 << 20)
    flags = {"model": "m", "weight_transport": "collective", "ucx_port": 0}
    assert load_settings(TrainerSettings, None, flags, environ=env).weight_transport == "collective"
    with pytest.raises(
        SettingsError, match="ucx_port: Input should be less than or equal to 65535"
    ):
        load_settings(TrainerSettings, None, {"model": "m", "ucx_port": 70000}, environ={})
    defaults = TrainerSettings(model=Path("m"))
    assert (defaults.ucx_host, defaults.ucx_port, defaults.collective_bucket_bytes) == (
        "127.0.0.1",
        0,
        32 << 20,
    )


def test_what_a_transport_needs_is_checked(monkeypatch):
    assert unavailable_reason("object_store") is None
    assert unavailable_reason("filesystem") is None
    assert unavailable_reason("ucx") is None  # ucxx is installed here (the ucx extra)
    reason = unavailable_reason("ucx", ucx_module="no_such_ucxx")
    assert reason is not None
    assert reason.startswith("weight transport 'ucx' needs the 'no_such_ucxx' package")
    assert "pip install -e '.[ucx]'" in reason
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    assert unavailable_reason("collective") == (
        "weight transport 'collective' needs torch.distributed, which this torch build does not "
        "have; choose another transport"
    )


def test_ucx_without_ucxx_is_a_configuration_error(tmp_path: Path):
    # The model directory does not exist: the transport is checked first, before any work.
    done = _cli(
        "sys.modules['ucxx'] = None  # as if the ucx extra were not installed",
        "trainer",
        "--model",
        str(tmp_path / "nope"),
        "--weight-transport",
        "ucx",
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(
        "plexrl trainer: weight transport 'ucx' needs the 'ucxx' package, which cannot be imported"
    )
    assert "is not a Hugging Face model directory" not in done.stderr


def test_collective_without_torch_distributed_is_a_configuration_error(tmp_path: Path):
    done = _cli(
        "import torch.distributed\ntorch.distributed.is_available = lambda: False",
        "trainer",
        "--model",
        str(tmp_path / "nope"),
        "--weight-transport",
        "collective",
    )
    assert done.returncode == 2
    assert done.stderr == (
        "plexrl trainer: weight transport 'collective' needs torch.distributed, which this torch "
        "build does not have; choose another transport\n"
    )


async def test_a_ucx_port_in_use_stops_the_trainer_at_start_up(tiny_dir: Path, nats_url: str):
    from services.weights.ucx import UcxWeightServer

    holder = UcxWeightServer()
    await holder.start()
    try:
        done = await _run_async(
            "trainer",
            "--model",
            str(tiny_dir),
            "--nats-url",
            nats_url,
            "--weight-transport",
            "ucx",
            "--ucx-port",
            str(holder.port),
        )
    finally:
        await holder.close()
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        f"plexrl trainer: cannot listen for UCX weight transfers on port {holder.port}"
        in done.stderr
    )


async def _run_async(*args: str) -> subprocess.CompletedProcess[str]:
    import asyncio

    # The listener holding the port lives on this event loop: wait without blocking it.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services",
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return subprocess.CompletedProcess(list(args), proc.returncode, out.decode(), err.decode())


def test_the_publisher_is_built_for_the_chosen_transport(tmp_path: Path):
    from services.weights.ucx import UcxWeightServer

    bus = object.__new__(Bus)  # never used by the constructors
    settings = TrainerSettings(
        model=tmp_path, weight_transport="ucx", ucx_host="10.1.2.3", ucx_port=7001, keep_weights=5
    )
    publisher = build_publisher(settings, bus)
    assert publisher.transport == "ucx"
    assert isinstance(publisher.sender, UcxWeightServer)
    assert (publisher.sender.host, publisher.sender.port, publisher.sender.keep_last) == (
        "10.1.2.3",
        7001,
        5,
    )
    plain = build_publisher(TrainerSettings(model=tmp_path), bus)
    assert (plain.transport, plain.sender.name) == ("object_store", "object_store")


def test_the_collective_publisher_gets_a_collective_sender(tmp_path: Path):
    collective = pytest.importorskip("services.weights.collective")
    bus = object.__new__(Bus)
    settings = TrainerSettings(
        model=tmp_path,
        weight_transport="collective",
        collective_host="10.1.2.4",
        collective_port=29777,
        collective_bucket_bytes=4 << 20,
    )
    publisher = build_publisher(settings, bus)
    sender = publisher.sender
    assert isinstance(sender, collective.CollectiveSender)
    assert (sender.host, sender.port, sender.bucket_bytes) == ("10.1.2.4", 29777, 4 << 20)


def test_an_unavailable_transport_is_refused_when_building(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    settings = TrainerSettings(model=tmp_path, weight_transport="collective")
    with pytest.raises(TransportUnavailable, match=r"needs torch\.distributed"):
        build_publisher(settings, object.__new__(Bus))


async def test_a_ucx_trainer_announces_adapters_that_replicas_load(own_nats, tmp_path, tiny_dir):
    cluster = await Cluster(
        own_nats.url, tmp_path / "out", tiny_dir, weight_transport="ucx", keep_weights=1
    ).start()
    bus = await Bus.connect(own_nats.url, "test")
    try:
        trainer = cluster.trainer
        assert trainer is not None
        await submit(bus, "run_a", run_config())
        await publish_batch(bus, make_batch("run_a", 0))
        [event] = await eventually(lambda: weights_events(bus, "run_a"))
        port = trainer.publisher.sender.port  # type: ignore[union-attr]
        assert (event.step, event.transport) == (1, "ucx")
        assert event.location == f"ucx://127.0.0.1:{port}/run_a/step_1"
        assert not (tmp_path / "out" / "run_a" / "broadcast").exists()
        loaded = await load_weights(bus, event)
        assert same_tensors(loaded, trainer.lora.slot_state_dict(cluster.state("run_a").idx))
    finally:
        await bus.close()
        await cluster.close()
