"""The ``ucx`` transport over real UCX (TCP): publish, pull from several replicas at once, receive
a whole model in place, and fail cleanly, keeping the previous version, when the trainer dies or
stalls mid-transfer."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from schemas.events import LoraSpec, WeightsReady
from schemas.subjects import ERRORS_WILDCARD
from services.bus import Bus
from services.inference.weights_follower import WeightsFollower
from services.weights import EncodedStream, WeightPublisher, WeightsError, load_weights
from services.weights.digest import digest_of
from services.weights.errors import TransportUnavailable
from services.weights.ucx import UcxWeightClient, UcxWeightServer, _tag, import_ucxx
from tests.weights.announce import announcement

UCX_LORA = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj"])

try:
    import_ucxx()  # sets the TCP defaults before ucxx reads the environment
except ImportError:
    pytest.skip("ucxx is not installed (pip install -e '.[ucx]')", allow_module_level=True)

PEER = Path(__file__).with_name("ucx_peer.py")
REPO = Path(__file__).parents[2]


def _same(got: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert list(got) == sorted(sent)
    for key, tensor in sent.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


@pytest.fixture
async def server() -> AsyncIterator[UcxWeightServer]:
    s = UcxWeightServer(keep_last=2, chunk_bytes=1 << 20)
    await s.start()
    yield s
    await s.close()


@pytest.fixture
async def client() -> AsyncIterator[UcxWeightClient]:
    c = UcxWeightClient(connect_timeout=5.0, stall_timeout=10.0)
    yield c
    await c.close()


async def test_an_adapter_published_over_ucx_loads_bit_for_bit(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
):
    publisher = WeightPublisher(bus, tmp_path, transport="ucx", keep_last=2)
    await publisher.start()
    try:
        event = await publisher.publish(run_id, 7, 3, adapter, lora)
        assert publisher.sender is not None
        port = publisher.sender.port  # type: ignore[attr-defined]
        assert (event.transport, event.location) == (
            "ucx",
            f"ucx://127.0.0.1:{port}/{run_id}/step_3",
        )
        expected = EncodedStream.from_state_dict(adapter).to_bytes()
        assert event.size_bytes == len(expected)
        assert event.digest == digest_of([expected])
        assert not list(tmp_path.iterdir())  # nothing went to disk
        _same(await load_weights(bus, event), adapter)
    finally:
        await publisher.close()


async def test_only_the_last_versions_are_held_and_a_dropped_one_is_named(
    bus: Bus, tmp_path: Path, run_id: str, make_adapter, lora, client: UcxWeightClient
):
    server = UcxWeightServer(keep_last=2)
    publisher = WeightPublisher(bus, tmp_path, transport="ucx", keep_last=2, sender=server)
    events = [await publisher.publish(run_id, 0, s, make_adapter(s), lora) for s in (1, 2, 3, 4)]
    try:
        assert server.held(run_id) == [3, 4]
        with pytest.raises(
            WeightsError,
            match=f"^weights for {run_id} step 1: the trainer at ucx://127.0.0.1:{server.port} "
            f"holds no weights under tag '{run_id}/step_1'",
        ):
            await client.fetch(events[0])
        # a refusal leaves the connection in service
        endpoint = client._endpoints[("127.0.0.1", server.port)]
        _same(await client.fetch(events[3]), make_adapter(4))
        assert client._endpoints[("127.0.0.1", server.port)] is endpoint
    finally:
        await publisher.close()


async def test_many_requests_share_one_connection_and_many_clients_pull_at_once(
    server: UcxWeightServer, run_id: str, make_adapter
):
    adapters = {step: make_adapter(step) for step in (1, 2)}
    events = []
    for step, state in adapters.items():
        stream = EncodedStream.from_state_dict(state)
        events.append(
            announcement(
                run_id, step, "ucx", await server.send(run_id, step, stream), stream, UCX_LORA
            )
        )
    clients = [UcxWeightClient() for _ in range(3)]
    try:
        results = await asyncio.gather(*(c.fetch(e) for c in clients for e in events * 2))
        for i, got in enumerate(results):
            _same(got, adapters[events[i % 2].step])
        assert all(len(c._endpoints) == 1 for c in clients)
    finally:
        for c in clients:
            await c.close()


def _mixed_state() -> dict[str, torch.Tensor]:
    """Many small tensors (an adapter's shape), a few large ones, an empty one, mixed dtypes."""
    generator = torch.Generator().manual_seed(5)
    state = {
        f"layer.{i:03d}.lora_{ab}.weight": torch.randn(4, 96 + i, generator=generator)
        for i in range(120)
        for ab in "AB"
    }
    state["big.weight"] = torch.randn(700, 1000, generator=generator)  # 2.7 MB: 3 pieces
    state["half.weight"] = torch.randn(300, 1000, generator=generator).to(torch.bfloat16)
    state["empty.weight"] = torch.empty(0, 3)
    return state


async def test_small_tensors_travel_together(
    server: UcxWeightServer,
    client: UcxWeightClient,
    run_id: str,
    monkeypatch: pytest.MonkeyPatch,
):
    """The small tensors share buckets, so they take a few messages, not one per tensor."""
    from services.weights.ucx import client as ucx_client
    from services.weights.ucx import server as ucx_server
    from services.weights.ucx import wire

    posted: dict[str, list[int]] = {"send": [], "recv": []}
    original = wire._pipeline

    async def counting(ep: Any, op: str, pieces: Any, *args: Any) -> None:
        def counted() -> Any:
            for piece in pieces:
                posted[op].append(len(piece[0]))
                yield piece

        await original(ep, op, counted(), *args)

    monkeypatch.setattr(ucx_server, "_pipeline", counting)
    monkeypatch.setattr(ucx_client, "_pipeline", counting)
    state = _mixed_state()
    stream = EncodedStream.from_state_dict(state)
    event = announcement(run_id, 1, "ucx", await server.send(run_id, 1, stream), stream, UCX_LORA)
    got = await client.fetch(event)
    _same(got, state)
    received = posted["recv"]
    # Both ends cut the data the same way.
    assert posted["send"] == received
    assert sum(received) == stream.size - len(stream.header)
    # 240 small tensors share 1 MiB buckets; the large tensors go in pieces of their own.
    assert len(received) < 10


async def test_three_replica_processes_pull_a_stream_at_once(server: UcxWeightServer, run_id: str):
    g = torch.Generator().manual_seed(3)
    state = {f"layer{i}.weight": torch.randn(512, 1024 + i, generator=g) for i in range(3)}
    stream = EncodedStream.from_state_dict(state)  # 6 MiB: 6 pieces of 1 MiB per replica
    event = announcement(run_id, 5, "ucx", await server.send(run_id, 5, stream), stream, UCX_LORA)
    wire = msgspec.json.encode(event).decode()
    replicas = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(PEER),
            "fetch",
            wire,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(3)
    ]
    outputs = await asyncio.wait_for(asyncio.gather(*(r.communicate() for r in replicas)), 120)
    for replica, (out, err) in zip(replicas, outputs, strict=True):
        assert replica.returncode == 0, err.decode()[-2000:]
        assert json.loads(out.decode().splitlines()[-1]) == {"digest": stream.digest, "tensors": 3}


async def test_full_weights_are_received_into_the_model_parameters(
    server: UcxWeightServer, client: UcxWeightClient, run_id: str, monkeypatch
):
    from transformers import LlamaForCausalLM

    from services.model.tiny import tiny_config

    torch.manual_seed(0)
    trained = LlamaForCausalLM(tiny_config())
    torch.manual_seed(1)
    serving = LlamaForCausalLM(tiny_config())
    sent = {k: p.detach() for k, p in trained.named_parameters()}
    stream = EncodedStream.from_state_dict(sent)
    event = announcement(run_id, 1, "ucx", await server.send(run_id, 1, stream), stream, UCX_LORA)
    destination = dict(serving.named_parameters())
    pointers = {k: p.data_ptr() for k, p in destination.items()}
    assert not all(torch.equal(destination[k], sent[k]) for k in sent)

    # Receiving in place allocates no tensor at all (the header is a small bytearray).
    allocations: list[tuple[Any, ...]] = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: allocations.append(a) or empty(*a, **kw))
    got = await client.fetch(event, destination=destination)
    monkeypatch.undo()

    assert allocations == []
    assert set(got) == set(sent)
    for key, tensor in got.items():
        assert tensor is destination[key] and tensor.data_ptr() == pointers[key]
        assert torch.equal(tensor, sent[key]), key
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(serving(ids).logits, trained(ids).logits)


async def test_a_destination_that_does_not_fit_is_refused_and_left_alone(
    server: UcxWeightServer, client: UcxWeightClient, run_id: str
):
    stream = EncodedStream.from_state_dict({"w": torch.ones(4, 4)})
    event = announcement(run_id, 1, "ucx", await server.send(run_id, 1, stream), stream, UCX_LORA)
    destination = {"w": torch.zeros(4, 5)}
    with pytest.raises(
        WeightsError,
        match=rf"^weights for {run_id} step 1: tensor 'w' is torch.float32 \[4, 4\] in the stream",
    ):
        await client.fetch(event, destination=destination)
    assert torch.equal(destination["w"], torch.zeros(4, 5))


class _Stalling(UcxWeightServer):
    async def _send_stream(self, ep: Any, request_id: int, stream: EncodedStream) -> None:
        if len(stream.names) == 1:  # the stream to stall on
            await ep.send(memoryview(stream.header), tag=_tag(request_id, 1))
            await asyncio.Event().wait()
        await super()._send_stream(ep, request_id, stream)


async def test_a_stalled_transfer_times_out_and_the_next_fetch_reconnects(run_id: str, adapter):
    server = _Stalling()
    await server.start()
    client = UcxWeightClient(stall_timeout=0.5)
    try:
        stalled = EncodedStream.from_state_dict({"w": torch.ones(1000)})
        good = EncodedStream.from_state_dict(adapter)
        bad_event = announcement(
            run_id, 1, "ucx", await server.send(run_id, 1, stalled), stalled, UCX_LORA
        )
        good_event = announcement(
            run_id, 2, "ucx", await server.send(run_id, 2, good), good, UCX_LORA
        )
        _same(await client.fetch(good_event), adapter)
        first = client._endpoints[("127.0.0.1", server.port)]
        with pytest.raises(
            WeightsError,
            match=f"^weights for {run_id} step 1: transfer from ucx://127.0.0.1:{server.port} "
            "failed \\(timed out\\)",
        ):
            await client.fetch(bad_event)
        assert first.closed and ("127.0.0.1", server.port) not in client._endpoints
        _same(await client.fetch(good_event), adapter)
        assert client._endpoints[("127.0.0.1", server.port)] is not first
    finally:
        await client.close()
        await server.close()


async def test_nothing_listening_is_a_clear_error(client: UcxWeightClient, run_id: str):
    from services.bus import free_port

    port = free_port()
    stream = EncodedStream.from_state_dict({"w": torch.ones(2)})
    event = announcement(
        run_id, 1, "ucx", f"ucx://127.0.0.1:{port}/{run_id}/step_1", stream, UCX_LORA
    )
    with pytest.raises(
        WeightsError,
        match=f"^weights for {run_id} step 1: cannot connect to the trainer at "
        f"ucx://127.0.0.1:{port}",
    ):
        await asyncio.wait_for(client.fetch(event), 30)


async def test_a_port_in_use_is_reported_as_unavailable(server: UcxWeightServer):
    second = UcxWeightServer(port=server.port)
    with pytest.raises(
        TransportUnavailable, match=f"cannot listen for UCX weight transfers on port {server.port}"
    ):
        await second.start()


async def test_a_trainer_killed_mid_transfer_fails_the_load_and_the_previous_version_stays(
    bus: Bus, nats_url: str, tmp_path: Path, run_id: str
):
    installed: dict[str, int] = {}

    async def install(event: WeightsReady, tensors: dict[str, Any]) -> None:
        installed[event.run_id] = event.step

    follower = WeightsFollower(
        bus,
        wanted=lambda event, _headers, _tenant: event.run_id == run_id,
        install=install,
        attempts=1,
    )
    errors = await bus.nc.subscribe(ERRORS_WILDCARD)
    trainer = await asyncio.create_subprocess_exec(
        sys.executable,
        str(PEER),
        "serve",
        nats_url,
        run_id,
        str(tmp_path),
        "200",
        cwd=REPO,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert trainer.stdin is not None and trainer.stdout is not None
    try:
        assert await asyncio.wait_for(trainer.stdout.readline(), 60) == b"READY\n"
        await follower.start()
        while installed.get(run_id) != 1:
            await asyncio.sleep(0.02)
        trainer.stdin.write(b"go\n")
        await trainer.stdin.drain()
        # The replica has the header and the first piece of the 200 MB adapter; kill the trainer.
        assert await asyncio.wait_for(trainer.stdout.readline(), 60) == b"MID\n"
        trainer.send_signal(signal.SIGKILL)
        await trainer.wait()
        await asyncio.wait_for(follower.idle(), 30)
        assert installed == {run_id: 1}
        assert follower.failed[run_id] == 1 and follower.tries[(run_id, 2)] == 1
        report = json.loads((await errors.next_msg(timeout=10)).data)
        while report.get("run_id") != run_id:  # other tests share the server
            report = json.loads((await errors.next_msg(timeout=10)).data)
        assert (
            f"adapter of {run_id} at step 2 rejected after 1 attempts, the previous version"
            in (report["error"])
        )
        assert f"weights for {run_id} step 2: transfer from ucx://127.0.0.1:" in report["error"]
    finally:
        await follower.stop()
        await errors.unsubscribe()
        if trainer.returncode is None:
            trainer.kill()
            await trainer.wait()


_CLOSED_SERVER = """
import asyncio, gc, torch
from schemas.events import LoraSpec, WeightsReady
from services.weights import EncodedStream, WeightsError
from services.weights import ucx

async def main():
    stream = EncodedStream.from_state_dict({"a": torch.arange(1000, dtype=torch.float32)})
    server = ucx.UcxWeightServer(keep_last=4, chunk_bytes=1 << 14)
    await server.start()
    location = await server.send("run_closed", 1, stream)
    event = WeightsReady(run_id="run_closed", idx=0, step=1, transport="ucx", location=location,
        digest=stream.digest, size_bytes=stream.size,
        lora=LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj"]))
    client = ucx.UcxWeightClient(connect_timeout=2.0)
    got = await client.fetch(event)
    print("RESULT first", bool(torch.equal(got["a"], torch.arange(1000, dtype=torch.float32))))
    await server.close()
    gc.collect()
    for _ in range(3):
        try:
            await client.fetch(event)
            print("RESULT fetched from a closed server")
        except WeightsError:
            print("RESULT refused")
        await asyncio.sleep(0.1)
    await client.close()

asyncio.run(main())
"""


def test_asking_a_closed_server_is_a_clear_error_not_a_crash() -> None:
    # A closed server's listener used to outlive it in UCX (an accepted endpoint, kept alive
    # by a traceback, held it), and a connection to the closed port then ran the listener's
    # callback on freed memory: KeyError 'cb_func', or a segfault about one time in two.
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _CLOSED_SERVER],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # (ucxx writes its own log lines to stdout as well)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert results == ["RESULT first True"] + ["RESULT refused"] * 3
    assert "cb_func" not in done.stdout + done.stderr
    assert "SystemError" not in done.stdout + done.stderr
