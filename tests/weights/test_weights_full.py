"""Full weights: a whole model's state dict published with ``kind="full"`` over each transport,
received in place into another model's parameters, refused with the destination untouched when
it cannot fit, reported as touched when it was partly overwritten, and never held twice."""

from __future__ import annotations

import asyncio
import json
import threading
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file as st_load_file

from schemas.events import LoraSpec, WeightsReady
from schemas.subjects import WEIGHTS_STREAM, weights_subject
from services.bus import Bus
from services.model.peft_io import ADAPTER_CONFIG, FULL_WEIGHTS_FILE
from services.weights import EncodedStream, WeightPublisher, WeightsError, load_weights
from services.weights.blobs import get_blob, write_blob
from services.weights.digest import digest_of
from services.weights.transport import unavailable_reason
from tests.weights.announce import announcement

State = dict[str, torch.Tensor]


class _TinyLM(torch.nn.Module):
    """About 3 MB of float32 parameters, with the output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 256)
        self.up = torch.nn.Linear(256, 1024)
        self.down = torch.nn.Linear(1024, 256)
        self.norm = torch.nn.LayerNorm(256)
        self.head = torch.nn.Linear(256, 1000, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(self.norm(h + self.down(torch.relu(self.up(h)))))


def tiny_lm(seed: int, dtype: torch.dtype = torch.float32) -> _TinyLM:
    model = _TinyLM()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=g))
    return model.to(dtype).eval()


def weights_of(model: torch.nn.Module) -> State:
    """What a full-weight trainer publishes: each parameter once, by its name."""
    return {name: p.detach() for name, p in model.named_parameters()}


def _assert_in_place(got: State, destination: State, pointers: dict[str, int], sent: State) -> None:
    assert sorted(got) == sorted(destination) == sorted(sent)
    for name, tensor in got.items():
        assert tensor is destination[name], name
        assert tensor.data_ptr() == pointers[name], name
        assert torch.equal(tensor, sent[name]), name


def _pointers(destination: State) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in destination.items()}


def _snapshot(destination: State) -> State:
    return {name: t.detach().clone() for name, t in destination.items()}


def _unchanged(destination: State, before: State) -> bool:
    return all(torch.equal(destination[name], before[name]) for name in before)


OFF_THE_CPU_PATH = [
    "strided",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.fixture(params=OFF_THE_CPU_PATH)
def off_the_cpu_path(request: pytest.FixtureRequest) -> Callable[[torch.nn.Module], State]:
    """Tensors that cannot take bytes in place, as a GPU replica's cannot: a strided copy of
    each parameter on the CPU (CI), or the parameter on the GPU itself (where there is one). A
    receiver stages them on the CPU and copies them in once the digest matched."""

    def strided(model: torch.nn.Module) -> State:
        out: State = {}
        for name, p in model.named_parameters():
            t = torch.zeros(p.numel() * 2, dtype=p.dtype)[::2].view(p.shape)
            out[name] = t.copy_(p.detach())
        return out

    def on_cuda(model: torch.nn.Module) -> State:
        return {name: p.detach().to("cuda") for name, p in model.named_parameters()}

    return strided if request.param == "strided" else on_cuda


def _equal(state: State, sent: State) -> bool:
    """``state`` (on whatever device) holds ``sent``'s values."""
    return all(torch.equal(state[k].cpu(), sent[k]) for k in sent)


def _holds(got: State, destination: State, sent: State) -> bool:
    """``got`` is ``destination``, tensor for tensor, and holds ``sent``'s values."""
    return all(got[k] is destination[k] for k in sent) and _equal(got, sent)


@pytest.fixture
def trained() -> _TinyLM:
    return tiny_lm(1)


@pytest.fixture
def serving() -> _TinyLM:
    return tiny_lm(2)


# --- object store -------------------------------------------------------------------------------


async def test_object_store_full_weights_land_in_the_parameters(
    bus: Bus, tmp_path: Path, run_id: str, lora: LoraSpec, trained: _TinyLM, serving: _TinyLM
):
    sent = weights_of(trained)
    assert "head.weight" not in sent  # tied to embed.weight: published once
    event = await WeightPublisher(bus, tmp_path).publish(run_id, 0, 1, sent, lora, kind="full")
    assert (event.kind, event.is_full, event.location) == ("full", True, f"{run_id}/step_1")
    stored = await get_blob(bus, event.location)
    assert stored == EncodedStream.from_state_dict(sent).to_bytes()
    assert event.digest == digest_of([stored])
    assert event.size_bytes == len(stored)
    assert all(torch.equal(t, sent[k]) for k, t in st_load(stored).items())

    destination = dict(serving.named_parameters())
    pointers = _pointers(destination)
    assert not torch.equal(destination["up.weight"], sent["up.weight"])
    got = await load_weights(bus, event, destination=destination)
    _assert_in_place(got, destination, pointers, sent)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(serving(ids), trained(ids))
    # Without a destination the same event gives fresh tensors (and no LoRA rank check).
    fresh = await load_weights(bus, event)
    assert sorted(fresh) == sorted(sent)
    assert all(torch.equal(fresh[k], sent[k]) and fresh[k] is not sent[k] for k in sent)


async def test_full_and_adapter_announcements_on_the_wire(
    bus: Bus, tmp_path: Path, run_id: str, lora: LoraSpec, adapter: State, trained: _TinyLM
):
    publisher = WeightPublisher(bus, tmp_path)
    adapter_event = await publisher.publish(run_id, 0, 1, adapter, lora)
    assert adapter_event.kind is msgspec.UNSET and not adapter_event.is_full
    assert b'"kind"' not in msgspec.json.encode(adapter_event)
    raw = await bus.js.get_last_msg(WEIGHTS_STREAM, weights_subject(run_id))
    assert raw.data is not None and b'"kind"' not in raw.data

    full_event = await publisher.publish(run_id, 0, 2, weights_of(trained), lora, kind="full")
    raw = await bus.js.get_last_msg(WEIGHTS_STREAM, weights_subject(run_id))
    assert raw.data is not None and json.loads(raw.data)["kind"] == "full"
    assert msgspec.json.decode(raw.data, type=WeightsReady) == full_event
    with pytest.raises(ValueError, match="kind must be 'lora' or 'full'"):
        await publisher.publish(run_id, 0, 3, adapter, lora, kind="half")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d.update({"up.weight": torch.zeros(1024, 255)}),
            r"tensor 'up.weight' is torch.float32 \[1024, 256\] in the stream but "
            r"torch.float32 \[1024, 255\] in the destination$",
        ),
        (lambda d: d.pop("norm.bias"), "the destination has no tensor 'norm.bias'"),
        (
            lambda d: d.update({"extra.weight": torch.zeros(3)}),
            "the stream has no tensor 'extra.weight' of the destination",
        ),
        (
            lambda d: d.update({"down.bias": torch.zeros(256, dtype=torch.bfloat16)}),
            r"tensor 'down.bias' is torch.float32 \[256\] in the stream but torch.bfloat16 "
            r"\[256\] in the destination: the trainer and inference must use the same dtype",
        ),
    ],
    ids=["shape", "missing", "extra", "dtype"],
)
@pytest.mark.parametrize("transport", ["object_store", "filesystem"])
async def test_a_destination_that_does_not_fit_is_refused_untouched(
    bus: Bus,
    tmp_path: Path,
    run_id: str,
    lora: LoraSpec,
    trained: _TinyLM,
    serving: _TinyLM,
    transport: Any,
    change: Callable[[State], Any],
    message: str,
):
    event = await WeightPublisher(bus, tmp_path, transport=transport).publish(
        run_id, 0, 1, weights_of(trained), lora, kind="full"
    )
    destination = dict(serving.named_parameters())
    change(destination)
    before = _snapshot(destination)
    with pytest.raises(WeightsError, match=f"^weights for {run_id} step 1: .*{message}") as err:
        await load_weights(bus, event, tmp_path, destination=destination)
    assert err.value.touched is False
    assert _unchanged(destination, before)


async def test_a_corrupted_object_is_reported_as_touched(
    bus: Bus, tmp_path: Path, run_id: str, lora: LoraSpec, trained: _TinyLM, serving: _TinyLM
):
    event = await WeightPublisher(bus, tmp_path).publish(
        run_id, 0, 1, weights_of(trained), lora, kind="full"
    )
    stored = bytearray(await get_blob(bus, event.location))
    stored[-1] ^= 0x01  # one bit of the last tensor; the description keeps the announced digest
    await write_blob(bus, event.location, bytes(stored), event.digest)
    destination = dict(serving.named_parameters())
    before = _snapshot(destination)
    with pytest.raises(
        WeightsError, match=f"^weights for {run_id} step 1: digest mismatch: announced"
    ) as err:
        await load_weights(bus, event, destination=destination)
    assert err.value.touched is True
    assert not _unchanged(destination, before)  # the bytes did land: the flag is no formality


async def test_an_object_replaced_by_other_weights_is_refused_before_a_byte_lands(
    bus: Bus, tmp_path: Path, run_id: str, lora: LoraSpec, trained: _TinyLM, serving: _TinyLM
):
    event = await WeightPublisher(bus, tmp_path).publish(
        run_id, 0, 1, weights_of(trained), lora, kind="full"
    )
    other = EncodedStream.from_state_dict(weights_of(tiny_lm(3)))
    assert other.size == event.size_bytes
    await write_blob(bus, event.location, other.segments(), other.digest)
    destination = dict(serving.named_parameters())
    before = _snapshot(destination)
    with pytest.raises(WeightsError, match="holds other bytes than expected") as err:
        await load_weights(bus, event, destination=destination)
    assert err.value.touched is False
    assert _unchanged(destination, before)


async def test_reading_a_big_full_object_never_holds_it_whole(
    bus: Bus, tmp_path: Path, run_id: str, lora: LoraSpec
):
    g = torch.Generator().manual_seed(5)
    sent = {f"layers.{i}.weight": torch.randn(1024, 3072 + i, generator=g) for i in range(4)}
    size = sum(t.numel() * t.element_size() for t in sent.values())  # about 50 MB
    destination = {name: torch.zeros_like(t) for name, t in sent.items()}
    pointers = _pointers(destination)
    publisher = WeightPublisher(bus, tmp_path)
    # tracemalloc sees every bytes object (a blob, a chunk, a joined buffer), not tensor storage.
    tracemalloc.start()
    try:
        event = await publisher.publish(run_id, 0, 1, sent, lora, kind="full")
        _, publish_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        got = await load_weights(bus, event, destination=destination)
        _, load_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert event.size_bytes > size
    _assert_in_place(got, destination, pointers, sent)
    # Chunks of 1 MiB in flight, a few at a time: far below one copy of the blob.
    assert load_peak < size // 4, (load_peak, size)
    assert publish_peak < size // 2, (publish_peak, size)


# --- filesystem ---------------------------------------------------------------------------------


async def test_filesystem_full_weights_are_a_model_file_read_into_the_parameters(
    bus: Bus, tmp_path: Path, run_id: str, lora: LoraSpec, trained: _TinyLM, serving: _TinyLM
):
    sent = weights_of(trained)
    publisher = WeightPublisher(bus, tmp_path, transport="filesystem", keep_last=2)
    events = [
        await publisher.publish(run_id, 0, step, sent, lora, kind="full") for step in (1, 2, 3)
    ]
    broadcast = tmp_path / run_id / "broadcast"
    assert sorted(p.name for p in broadcast.iterdir()) == ["step_2", "step_3"]
    event = events[-1]
    directory = broadcast / "step_3"
    assert (event.kind, event.location) == ("full", str(directory))
    assert [p.name for p in directory.iterdir()] == [FULL_WEIGHTS_FILE]
    assert not (directory / ADAPTER_CONFIG).exists()
    data = (directory / FULL_WEIGHTS_FILE).read_bytes()
    assert (event.size_bytes, event.digest) == (
        len(data),
        digest_of([data]),
    )
    on_disk = st_load_file(directory / FULL_WEIGHTS_FILE)
    assert sorted(on_disk) == sorted(sent)
    assert all(torch.equal(on_disk[k], sent[k]) for k in sent)

    destination = dict(serving.named_parameters())
    pointers = _pointers(destination)
    got = await load_weights(bus, event, output_dir=tmp_path, destination=destination)
    _assert_in_place(got, destination, pointers, sent)
    fresh = await load_weights(bus, events[1], output_dir=tmp_path)
    assert all(torch.equal(fresh[k], sent[k]) for k in sent)


async def test_a_corrupted_model_file_is_reported_as_touched(
    bus: Bus, tmp_path: Path, run_id: str, lora: LoraSpec, trained: _TinyLM, serving: _TinyLM
):
    event = await WeightPublisher(bus, tmp_path, transport="filesystem").publish(
        run_id, 0, 1, weights_of(trained), lora, kind="full"
    )
    path = Path(event.location) / FULL_WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    destination = dict(serving.named_parameters())
    before = _snapshot(destination)
    with pytest.raises(WeightsError, match=f"{run_id} step 1: digest mismatch") as err:
        await load_weights(bus, event, output_dir=tmp_path, destination=destination)
    assert err.value.touched is True
    assert not _unchanged(destination, before)
    # A truncated file is refused from its size, before anything is read.
    path.write_bytes(bytes(data[: len(data) // 2]))
    destination = dict(tiny_lm(4).named_parameters())
    before = _snapshot(destination)
    with pytest.raises(WeightsError, match="size mismatch") as err:
        await load_weights(bus, event, output_dir=tmp_path, destination=destination)
    assert err.value.touched is False
    assert _unchanged(destination, before)


@pytest.mark.parametrize("transport", ["object_store", "filesystem"])
async def test_tensors_off_the_cpu_path_get_the_weights_only_once_the_digest_matched(
    bus: Bus,
    tmp_path: Path,
    run_id: str,
    lora: LoraSpec,
    trained: _TinyLM,
    transport: Any,
    off_the_cpu_path: Callable[[torch.nn.Module], State],
):
    publisher = WeightPublisher(bus, tmp_path, transport=transport)
    sent = weights_of(trained)
    event = await publisher.publish(run_id, 0, 1, sent, lora, kind="full")
    destination = off_the_cpu_path(tiny_lm(2))
    got = await load_weights(bus, event, tmp_path, destination=destination)
    assert _holds(got, destination, sent)
    # A corrupted step 2: staged, refused, and the destination still holds step 1.
    event = await publisher.publish(run_id, 0, 2, weights_of(tiny_lm(5)), lora, kind="full")
    if transport == "object_store":
        stored = bytearray(await get_blob(bus, event.location))
        stored[-1] ^= 0x01
        await write_blob(bus, event.location, bytes(stored), event.digest)
    else:
        path = Path(event.location) / FULL_WEIGHTS_FILE
        path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 0x01]))
    with pytest.raises(WeightsError, match="digest mismatch") as err:
        await load_weights(bus, event, tmp_path, destination=destination)
    assert err.value.touched is False
    assert _equal(destination, sent)


# --- ucx ----------------------------------------------------------------------------------------


@pytest.fixture
async def ucx_client() -> AsyncIterator[Any]:
    reason = unavailable_reason("ucx")
    if reason is not None:
        pytest.skip(reason)
    from services.weights.ucx import UcxWeightClient

    client = UcxWeightClient(connect_timeout=5.0, stall_timeout=10.0)
    yield client
    await client.close()


@pytest.fixture
async def ucx_server(ucx_client: Any) -> AsyncIterator[Any]:
    from services.weights.ucx import UcxWeightServer

    server = UcxWeightServer(keep_last=2, chunk_bytes=1 << 18)
    await server.start()
    yield server
    await server.close()


async def _sent(
    sender: Any,
    transport: Any,
    run_id: str,
    step: int,
    state: State,
    lora: LoraSpec,
    *,
    changed: bool = False,
) -> WeightsReady:
    """``state`` sent by a direct ``sender`` as ``run_id``'s ``step``, and its announcement;
    ``changed``: a byte changes after the digest was taken (the transfer lands, then fails)."""
    stream = EncodedStream.from_state_dict({k: t.clone() for k, t in state.items()})
    if changed:
        stream._tensors[0].add_(1.0)
    return announcement(
        run_id, step, transport, await sender.send(run_id, step, stream), stream, lora, kind="full"
    )


async def test_ucx_full_weights_land_in_place_and_only_the_newest_is_held(
    bus: Bus, tmp_path: Path, run_id: str, lora: LoraSpec, adapter: State, ucx_client: Any
):
    publisher = WeightPublisher(bus, tmp_path, transport="ucx", keep_last=3)
    await publisher.start()
    server: Any = publisher.sender
    fetchers = {"ucx": ucx_client}
    try:
        models = {step: tiny_lm(10 + step) for step in (1, 2, 3)}
        events = [
            await publisher.publish(run_id, 0, step, weights_of(m), lora, kind="full")
            for step, m in models.items()
        ]
        assert server.held(run_id) == [3]  # a whole model is held once, whatever keep_last
        assert all(e.kind == "full" for e in events)
        serving = tiny_lm(2)
        destination = dict(serving.named_parameters())
        pointers = _pointers(destination)
        got = await load_weights(bus, events[-1], fetchers=fetchers, destination=destination)
        _assert_in_place(got, destination, pointers, weights_of(models[3]))
        with pytest.raises(WeightsError, match="holds no weights under tag") as err:
            await load_weights(bus, events[0], fetchers=fetchers, destination=destination)
        assert err.value.touched is False
        # Adapters of another run keep their keep_last versions.
        other = f"{run_id}x"
        for step in (1, 2, 3, 4):
            await publisher.publish(other, 1, step, adapter, lora)
        assert server.held(other) == [2, 3, 4]
    finally:
        await publisher.close()


async def test_ucx_refusals_leave_the_destination_alone_and_corruption_is_touched(
    run_id: str,
    lora: LoraSpec,
    trained: _TinyLM,
    serving: _TinyLM,
    ucx_client: Any,
    ucx_server: Any,
):
    sent = weights_of(trained)
    event = await _sent(ucx_server, "ucx", run_id, 1, sent, lora)
    destination = dict(serving.named_parameters())
    destination["norm.weight"] = torch.zeros(256, dtype=torch.float16)
    before = _snapshot(destination)
    with pytest.raises(WeightsError, match="must use the same dtype") as err:
        await ucx_client.fetch(event, destination=destination)
    assert err.value.touched is False
    assert _unchanged(destination, before)

    # Bytes that changed after they were hashed land, then fail the digest.
    event = await _sent(ucx_server, "ucx", run_id, 2, sent, lora, changed=True)
    destination = dict(tiny_lm(4).named_parameters())
    before = _snapshot(destination)
    with pytest.raises(WeightsError, match="digest mismatch") as err:
        await ucx_client.fetch(event, destination=destination)
    assert err.value.touched is True
    assert not _unchanged(destination, before)


async def test_ucx_into_tensors_off_the_cpu_path_lands_after_the_digest(
    run_id: str,
    lora: LoraSpec,
    trained: _TinyLM,
    ucx_client: Any,
    ucx_server: Any,
    off_the_cpu_path: Callable[[torch.nn.Module], State],
):
    sent = weights_of(trained)
    event = await _sent(ucx_server, "ucx", run_id, 1, sent, lora)
    destination = off_the_cpu_path(tiny_lm(2))
    got = await ucx_client.fetch(event, destination=destination)
    assert _holds(got, destination, sent)
    event = await _sent(ucx_server, "ucx", run_id, 2, sent, lora, changed=True)
    before = _snapshot(destination)
    with pytest.raises(WeightsError, match="digest mismatch") as err:
        await ucx_client.fetch(event, destination=destination)
    assert err.value.touched is False
    assert _unchanged(destination, before)


async def test_a_ucx_transfer_cut_off_in_the_middle_is_touched(
    run_id: str, lora: LoraSpec, trained: _TinyLM, serving: _TinyLM, ucx_client: Any
):
    from services.weights.buckets import bucket_pieces
    from services.weights.ucx import UcxWeightClient, UcxWeightServer, _tag

    class HalfServer(UcxWeightServer):
        async def _send_stream(self, ep: Any, request_id: int, stream: EncodedStream) -> None:
            await ep.send(memoryview(stream.header), tag=_tag(request_id, 1))
            segments = stream.data_segments()
            first, _ = next(bucket_pieces(segments, self.chunk_bytes, sending=True))
            await ep.send(first, tag=_tag(request_id, 2))
            await asyncio.Event().wait()

    server = HalfServer(chunk_bytes=1 << 16)
    await server.start()
    client = UcxWeightClient(stall_timeout=0.5)
    try:
        stream = EncodedStream.from_state_dict(weights_of(trained))
        event = announcement(
            run_id, 1, "ucx", await server.send(run_id, 1, stream), stream, lora, kind="full"
        )
        destination = dict(serving.named_parameters())
        with pytest.raises(WeightsError, match="failed \\(timed out\\)") as err:
            await client.fetch(event, destination=destination)
        assert err.value.touched is True
        # Without a destination nothing of the caller's was written.
        with pytest.raises(WeightsError, match="failed \\(timed out\\)") as err:
            await client.fetch(event)
        assert err.value.touched is False
    finally:
        await client.close()
        await server.close()


# --- collective ---------------------------------------------------------------------------------


@pytest.fixture
async def collective(bus: Bus, nats_url: str, uid: str) -> AsyncIterator[tuple[Any, Any]]:
    """A sender and one in-process receiver that takes part in its group."""
    reason = unavailable_reason("collective")
    if reason is not None:
        pytest.skip(reason)
    from services.weights.collective import CollectiveReceiver, CollectiveSender

    group = f"t{uid}"
    sender = CollectiveSender(bus, "127.0.0.1", 0, bucket_bytes=1 << 18, group=group)
    await sender.start()
    rx_bus = await Bus.connect(nats_url, "inference")
    receiver = CollectiveReceiver(rx_bus, "rx-full", group=group, timeout=20.0, fetch_timeout=20.0)
    await receiver.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        while not (
            sender.members == [receiver.member_id] and receiver.generation == sender.generation
        ):
            assert loop.time() < deadline, "the receiver never joined the group"
            await asyncio.sleep(0.05)
        yield sender, receiver
    finally:
        await receiver.close()
        await rx_bus.close()
        await sender.close()


async def _until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition never met"
        await asyncio.sleep(0.02)


async def test_collective_full_weights_land_in_place_and_only_the_newest_is_held(
    bus: Bus, tmp_path: Path, run_id: str, lora: LoraSpec, serving: _TinyLM, collective: Any
):
    sender, receiver = collective
    publisher = WeightPublisher(bus, tmp_path, transport="collective", sender=sender, keep_last=3)
    fetchers = {"collective": receiver}
    destination = dict(serving.named_parameters())
    pointers = _pointers(destination)
    # Step 1 arrives before the replica names a destination: it is copied in.
    first = tiny_lm(11)
    event = await publisher.publish(run_id, 0, 1, weights_of(first), lora, kind="full")
    assert event.kind == "full"
    got = await load_weights(bus, event, fetchers=fetchers, destination=destination)
    _assert_in_place(got, destination, pointers, weights_of(first))
    # From then on the run's transfers are received straight into it.
    second = tiny_lm(12)
    event = await publisher.publish(run_id, 0, 2, weights_of(second), lora, kind="full")
    got = await load_weights(bus, event, fetchers=fetchers, destination=destination)
    _assert_in_place(got, destination, pointers, weights_of(second))
    assert receiver._received[run_id][2].in_place
    # Step 1 is forgotten at once, on the sender and on the replica.
    await _until(lambda: sorted(receiver._received[run_id]) == [2])
    assert {run: step for run, (step, _) in sender._latest.items()} == {run_id: 2}


async def test_collective_refusals_leave_the_destination_alone_and_corruption_is_touched(
    run_id: str, lora: LoraSpec, trained: _TinyLM, collective: Any
):
    sender, receiver = collective
    sent = weights_of(trained)
    # A destination registered before the transfer, of another dtype: refused from the header.
    half = {k: t.to(torch.float16) for k, t in weights_of(tiny_lm(2)).items()}
    receiver.receive_into(run_id, half)
    before = _snapshot(half)
    event = await _sent(sender, "collective", run_id, 1, sent, lora)
    with pytest.raises(WeightsError, match="must use the same dtype") as err:
        await receiver.fetch(event, destination=half)
    assert err.value.touched is False
    assert _unchanged(half, before)

    # One that was not registered gets a copy, only after every tensor is known to fit.
    other = f"{run_id}x"
    event = await _sent(sender, "collective", other, 1, sent, lora)
    await _until(lambda: 1 in receiver._received.get(other, {}))
    short = dict(tiny_lm(3).named_parameters())
    del short["up.bias"]
    before = _snapshot(short)
    with pytest.raises(WeightsError, match=r"the destination has no tensor 'up\.bias'") as err:
        await receiver.fetch(event, destination=short)
    assert err.value.touched is False
    assert _unchanged(short, before)

    # Bytes that change after they were hashed land in the registered destination, then fail.
    destination = dict(tiny_lm(4).named_parameters())
    receiver.receive_into(other, destination)
    before = _snapshot(destination)
    event = await _sent(sender, "collective", other, 2, sent, lora, changed=True)
    with pytest.raises(WeightsError, match="digest mismatch") as err:
        await receiver.fetch(event, destination=destination)
    assert err.value.touched is True
    assert not _unchanged(destination, before)


async def test_collective_into_tensors_off_the_cpu_path_lands_after_the_digest(
    run_id: str,
    lora: LoraSpec,
    trained: _TinyLM,
    collective: Any,
    off_the_cpu_path: Callable[[torch.nn.Module], State],
):
    sender, receiver = collective
    guard = threading.Lock()
    receiver.write_guard = guard
    sent = weights_of(trained)
    destination = off_the_cpu_path(tiny_lm(2))
    receiver.receive_into(run_id, destination)
    before = _snapshot(destination)
    # The staged tensors are copied in under the write guard, like bytes received in place:
    # held, it keeps the whole transfer (and the sender) waiting.
    guard.acquire()
    stream = EncodedStream.from_state_dict(sent)
    sending = asyncio.ensure_future(sender.send(run_id, 1, stream))
    await asyncio.sleep(0.5)
    assert not sending.done() and _unchanged(destination, before)
    guard.release()
    event = announcement(run_id, 1, "collective", await sending, stream, lora, kind="full")
    got = await receiver.fetch(event, destination=destination)
    assert _holds(got, destination, sent)
    event = await _sent(sender, "collective", run_id, 2, sent, lora, changed=True)
    with pytest.raises(WeightsError, match="digest mismatch") as err:
        await receiver.fetch(event, destination=destination)
    assert err.value.touched is False
    assert _equal(destination, sent)
