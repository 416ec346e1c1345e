"""Full weights on an inference replica: a trainer started with ``--full-weights`` announces
whole state dicts (``WeightsReady.kind == "full"``), which the torch engine writes into its base
model's parameters in place, between two batches; the run then generates with the base model
alone and no other run is served. A load that fails before writing keeps the previous version; one
that fails after writing part of the parameters leaves the run unserved until a good version."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from inference_support import LORA_TARGETS, discover, evict, lora_spec, random_adapter
from test_inference_service import ErrorWatch

from schemas.events import GenerateRequest, GenerateResponse, ServiceError, WeightsReady
from schemas.subjects import GENERATE, weights_object_key, weights_subject
from services.bus import Bus
from services.inference.jobs import InstalledFullWeights, Job, SlotChanged
from services.inference.torch_engine import TorchEngine
from services.inference.vllm_engine import VllmEngine
from services.model.loader import load_model
from services.model.lora import NO_ADAPTER, MultiLoRA
from services.model.sampling import SequenceSpec, generate_batch
from services.weights import EncodedStream, WeightPublisher, WeightsError
from services.weights.blobs import write_blob

PROMPTS = [[1, 10, 11, 12], [1, 20]]
EOS = [2]


class Reference:
    """A model of its own that takes any full state dict, for the generations a replica owes."""

    def __init__(self, model_dir: Path) -> None:
        self.model, _ = load_model(model_dir)
        self.params = dict(self.model.named_parameters())  # the names a trainer publishes
        self.base = {name: p.detach().clone() for name, p in self.params.items()}
        self.lora = MultiLoRA.attach(self.model, 1, 8)

    def trained(self, seed: int) -> dict[str, torch.Tensor]:
        """What a trainer might publish after a step: every parameter moved (by seeded noise)."""
        generator = torch.Generator().manual_seed(seed)
        return {
            name: t + 0.05 * torch.randn(t.shape, generator=generator)
            for name, t in self.base.items()
        }

    def greedy(
        self, state: Mapping[str, torch.Tensor], prompts: list[list[int]]
    ) -> list[list[int]]:
        self._hold(state)
        specs = [SequenceSpec(p, slot=NO_ADAPTER, max_tokens=8, temperature=0.0) for p in prompts]
        return [
            generate_batch(self.model, self.lora, [spec], eos_ids=EOS, pad_id=0)[0].token_ids
            for spec in specs
        ]

    def logprobs(
        self, state: Mapping[str, torch.Tensor], prompt: list[int], tokens: list[int]
    ) -> list[float]:
        """Log-probability of each of ``tokens`` after ``prompt``, from one forward without cache."""
        self._hold(state)
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
        return logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()

    def _hold(self, state: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(state[name])


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> Reference:
    return Reference(tiny_dir)


@asynccontextmanager
async def registered(bus: Bus, run_id: str, idx: int) -> AsyncIterator[str]:
    """A run known to replicas for the test's duration. Evicted afterwards: a replica started
    by a later test replays the stream, and would install this run's full weights otherwise."""
    await discover(bus, run_id, idx)
    try:
        yield run_id
    finally:
        await evict(bus, run_id, idx)


def _request(run_id: str, **kw: Any) -> GenerateRequest:
    fields: dict[str, Any] = {
        "request_id": f"req-{run_id}",
        "run_id": run_id,
        "prompts": PROMPTS,
        "n": 1,
        "max_tokens": 8,
        "temperature": 0.0,
        "timeout_s": 20.0,
    }
    return GenerateRequest(**(fields | kw))


async def _ask(bus: Bus, req: GenerateRequest) -> GenerateResponse:
    return await bus.request(GENERATE, req, GenerateResponse, timeout=req.timeout_s + 10.0)


def _tokens(resp: GenerateResponse) -> list[list[int]]:
    assert resp.error is None, resp.error
    return [group[0].token_ids for group in resp.completions]


def _pointers(engine: TorchEngine) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in engine.model.named_parameters()}


def _holds(engine: TorchEngine, state: Mapping[str, torch.Tensor]) -> bool:
    assert set(engine.base_parameters) == set(state)
    return all(torch.equal(engine.base_parameters[k], v) for k, v in state.items())


# --- over the bus ---------------------------------------------------------------------------------


async def test_full_weights_are_installed_in_place_and_serve_the_trained_model(
    bus: Bus, uid: str, start_replica, reference: Reference, tmp_path: Path
) -> None:
    service = await start_replica()
    engine: TorchEngine = service.engine
    before = _pointers(engine)
    trained = reference.trained(seed=1)
    expected = reference.greedy(trained, PROMPTS)
    assert expected != reference.greedy(reference.base, PROMPTS)  # the install must show
    async with registered(bus, f"run_full_{uid}", idx=0) as run_id:
        assert _tokens(await _ask(bus, _request(run_id))) == reference.greedy(
            reference.base, PROMPTS
        )
        event = await WeightPublisher(bus, tmp_path).publish(
            run_id, 0, 1, trained, lora_spec(), kind="full"
        )
        assert event.is_full
        resp = await _ask(bus, _request(run_id, min_policy_version=1))
        assert resp.policy_version == 1 and _tokens(resp) == expected
        # Sampled too: each token's log-probability is the trained model's.
        sampled = await _ask(bus, _request(run_id, temperature=1.0, n=2, seed=5))
        assert sampled.policy_version == 1
        for prompt, group in zip(PROMPTS, sampled.completions, strict=True):
            for completion in group:
                want = reference.logprobs(trained, prompt, completion.token_ids)
                assert completion.logprobs == pytest.approx(want, abs=1e-4)
        assert engine.full_weights == InstalledFullWeights(run_id, 1)
        assert _holds(engine, trained)
        assert _pointers(engine) == before  # written into the parameters, not replacing them
        assert service.follower.tries[(run_id, 1)] == 1


async def test_other_runs_are_refused_once_the_base_model_carries_a_runs_weights(
    bus: Bus, uid: str, start_replica, reference: Reference, tmp_path: Path
) -> None:
    service = await start_replica()
    async with (
        registered(bus, f"run_full_{uid}", idx=1) as run_id,
        registered(bus, f"run_lora_{uid}", idx=2) as other,
    ):
        assert (await _ask(bus, _request(other))).error is None  # served before the install
        await WeightPublisher(bus, tmp_path).publish(
            run_id, 1, 1, reference.trained(seed=2), lora_spec(), kind="full"
        )
        assert (await _ask(bus, _request(run_id, min_policy_version=1))).policy_version == 1
        refused = await _ask(bus, _request(other))
        assert refused.completions == [] and refused.error is not None
        assert f"{other} cannot be served by inference replica replica-a" in refused.error
        assert f"carries the full weights of {run_id}" in refused.error
        assert service.served[other] == 1


async def test_a_corrupted_full_blob_leaves_the_run_unserved_until_a_good_version(
    bus: Bus, uid: str, start_replica, reference: Reference, tmp_path: Path
) -> None:
    service = await start_replica()
    engine: TorchEngine = service.engine
    watch = await ErrorWatch().start(bus)
    publisher = WeightPublisher(bus, tmp_path)
    async with registered(bus, f"run_full_{uid}", idx=3) as run_id:
        await publisher.publish(run_id, 3, 1, reference.trained(seed=3), lora_spec(), kind="full")
        assert (await _ask(bus, _request(run_id, min_policy_version=1))).policy_version == 1
        # Step 2 as stored: one byte of the last tensor flipped after the digest was taken, and
        # the object's own description claiming the announced digest, so nothing tells before
        # the bytes have landed in the parameters.
        stream = EncodedStream.from_state_dict(reference.trained(seed=4))
        data = bytearray(stream.to_bytes())
        data[-1] ^= 0x40
        key = weights_object_key(run_id, 2)
        await write_blob(bus, key, bytes(data), stream.digest)
        corrupt = WeightsReady(
            run_id=run_id,
            idx=3,
            step=2,
            transport="object_store",
            location=key,
            digest=stream.digest,
            size_bytes=stream.size,
            lora=lora_spec(),
            kind="full",
        )
        await bus.publish(weights_subject(run_id), corrupt)
        (report,) = await watch.wait_for(
            lambda e: isinstance(e, ServiceError) and e.run_id == run_id
        )
        assert report.error.startswith(f"full weights of {run_id} at step 2 rejected after 2")
        assert f"so {run_id} is not served until a good version loads" in report.error
        assert report.context["touched"] == "True" and report.context["kind"] == "full"
        assert service.follower.tries[(run_id, 2)] == 2
        assert engine.full_weights is not None and engine.full_weights.version is None
        # Not even version 1 is served now: the parameters are neither step 1 nor step 2.
        timed_out = await _ask(bus, _request(run_id, timeout_s=0.5))
        assert timed_out.error is not None and "this replica has no version" in timed_out.error
        assert f"full weights of {run_id} at step 2 failed to load" in timed_out.error
        waiting = asyncio.create_task(_ask(bus, _request(run_id, min_policy_version=1)))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        trained = reference.trained(seed=5)
        await publisher.publish(run_id, 3, 3, trained, lora_spec(), kind="full")
        resp = await waiting
        assert resp.policy_version == 3 and _tokens(resp) == reference.greedy(trained, PROMPTS)
        assert engine.full_weights == InstalledFullWeights(run_id, 3)


async def test_full_weights_that_do_not_fit_keep_the_previous_version(
    bus: Bus, uid: str, start_replica, reference: Reference, tmp_path: Path
) -> None:
    service = await start_replica()
    engine: TorchEngine = service.engine
    watch = await ErrorWatch().start(bus)
    publisher = WeightPublisher(bus, tmp_path)
    async with registered(bus, f"run_full_{uid}", idx=0) as run_id:
        good = reference.trained(seed=6)
        await publisher.publish(run_id, 0, 1, good, lora_spec(), kind="full")
        assert (await _ask(bus, _request(run_id, min_policy_version=1))).policy_version == 1
        misfit = reference.trained(seed=7)
        misfit["model.norm.weight"] = misfit["model.norm.weight"][:-1].clone()
        await publisher.publish(run_id, 0, 2, misfit, lora_spec(), kind="full")
        (report,) = await watch.wait_for(
            lambda e: isinstance(e, ServiceError) and e.run_id == run_id
        )
        assert "at step 2 rejected after 2 attempts, the previous version stays" in report.error
        assert "model.norm.weight" in report.error
        assert report.context["touched"] == "False"
        assert engine.full_weights == InstalledFullWeights(run_id, 1)
        assert _holds(engine, good)
        resp = await _ask(bus, _request(run_id, min_policy_version=1))
        assert resp.policy_version == 1 and _tokens(resp) == reference.greedy(good, PROMPTS)


async def test_full_weights_arrive_over_ucx_into_the_parameters(
    bus: Bus, uid: str, start_replica, reference: Reference, tmp_path: Path
) -> None:
    from services.weights.ucx import import_ucxx

    try:
        import_ucxx()
    except ImportError:
        pytest.skip("ucxx is not installed (pip install -e '.[ucx]')")
    service = await start_replica()
    engine: TorchEngine = service.engine
    before = _pointers(engine)
    publisher = WeightPublisher(bus, tmp_path, transport="ucx", keep_last=1)
    await publisher.start()
    try:
        async with registered(bus, f"run_full_{uid}", idx=1) as run_id:
            trained = reference.trained(seed=8)
            event = await publisher.publish(run_id, 1, 1, trained, lora_spec(), kind="full")
            assert event.transport == "ucx" and event.is_full
            resp = await _ask(bus, _request(run_id, min_policy_version=1))
            assert resp.policy_version == 1 and _tokens(resp) == reference.greedy(trained, PROMPTS)
            assert _holds(engine, trained)
            assert _pointers(engine) == before
    finally:
        await publisher.close()


async def test_full_weights_broadcast_over_the_collective_land_between_batches(
    bus: Bus, nats_url: str, uid: str, tiny_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    from services.inference.service import InferenceService
    from services.weights.collective import CollectiveSender

    engine = TorchEngine(tiny_dir, max_runs=2, max_lora_rank=8, target_modules=LORA_TARGETS)
    before = None
    # A group of its own, so that replicas of other tests never meet this sender.
    sender = CollectiveSender(bus, "127.0.0.1", 0)
    publisher = WeightPublisher(bus, tmp_path, "collective", sender=sender)
    await publisher.start()
    replica_bus = await Bus.connect(nats_url, "inference")
    service = InferenceService(
        replica_bus,
        engine,
        max_runs=2,
        replica_name=f"replica-{uid}",
        output_dir=tmp_path,
        weight_transport="collective",
    )
    await service.start()
    try:
        receiver = service.receiver
        assert receiver is not None and receiver.write_guard is engine.write_guard
        await receiver.joined(timeout=30.0)
        before = _pointers(engine)
        async with registered(bus, f"run_full_{uid}", idx=1) as run_id:
            first, second = reference.trained(seed=11), reference.trained(seed=12)
            await publisher.publish(run_id, 1, 1, first, lora_spec(), kind="full")
            resp = await _ask(bus, _request(run_id, min_policy_version=1))
            assert resp.policy_version == 1 and _tokens(resp) == reference.greedy(first, PROMPTS)
            # From now on the run's transfers land in the parameters as they arrive: while a
            # batch holds the engine's guard, none may.
            engine.write_guard.acquire()
            try:
                publishing = asyncio.create_task(
                    publisher.publish(run_id, 1, 2, second, lora_spec(), kind="full")
                )
                await asyncio.sleep(1.0)
                assert not publishing.done()
                assert _holds(engine, first)
            finally:
                engine.write_guard.release()
            await asyncio.wait_for(publishing, 30.0)
            resp = await _ask(bus, _request(run_id, min_policy_version=2))
            assert resp.policy_version == 2 and _tokens(resp) == reference.greedy(second, PROMPTS)
            assert _holds(engine, second) and _pointers(engine) == before
    finally:
        await service.stop()
        await replica_bus.close()
        await publisher.close()


# --- the torch engine alone -----------------------------------------------------------------------


def _event(run_id: str, step: int) -> WeightsReady:
    return WeightsReady(
        run_id=run_id,
        idx=0,
        step=step,
        transport="object_store",
        location=f"{run_id}/step_{step}",
        digest="sha256:" + "0" * 64,
        size_bytes=1,
        lora=lora_spec(),
        kind="full",
    )


def _job(run_id: str, slot: int, **kw: Any) -> Job:
    fields: dict[str, Any] = {
        "request_id": f"{run_id}-job",
        "run_id": run_id,
        "slot": slot,
        "prompts": PROMPTS,
        "n": 1,
        "max_tokens": 8,
        "temperature": 0.0,
        "top_p": 1.0,
        "min_version": 0,
        "seed": 1,
    }
    return Job(**(fields | kw))


@pytest.fixture
async def engine(tiny_dir: Path) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(tiny_dir, max_runs=2, max_lora_rank=8, target_modules=LORA_TARGETS)
    await eng.start()
    eng.add_run(0, "run_full", 4, 8.0)
    eng.add_run(1, "run_other", 4, 8.0)
    yield eng
    await eng.close()


async def test_an_install_waits_for_the_running_batch_and_holds_the_next_one_off(
    engine: TorchEngine, reference: Reference
) -> None:
    trained = reference.trained(seed=9)
    before = _pointers(engine)
    installing = False
    forwards_while_installing = 0

    def count(module: Any, args: Any) -> None:
        nonlocal forwards_while_installing
        forwards_while_installing += installing

    hook = engine.model.register_forward_pre_hook(count)
    assert engine.eos_ids == EOS
    engine.eos_ids = []  # the long batch runs all its tokens
    running = asyncio.create_task(
        engine.generate(_job("run_full", 0, prompts=[[1, 10]], max_tokens=200))
    )
    while engine.num_batches == 0:
        await asyncio.sleep(0.002)
    arriving: list[asyncio.Task[Any]] = []

    async def load(destination: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        nonlocal installing
        installing = True
        engine.eos_ids = EOS
        for name, tensor in destination.items():
            tensor.copy_(trained[name])
            if not arriving:  # a job arriving mid-install waits for the install
                arriving.append(asyncio.create_task(engine.generate(_job("run_full", 0))))
            await asyncio.sleep(0.01)  # the batch loop gets every chance to start it
        installing = False
        return destination

    try:
        assert not running.done()
        assert await engine.install_full(_event("run_full", 1), load)
        old = await running
        new = await arriving[0]
    finally:
        hook.remove()
    # No forward pass ran while parameters were being written: the running batch finished on
    # the old weights first, and the arriving job waited for the new ones.
    assert forwards_while_installing == 0
    assert old.policy_version == 0 and len(old.completions[0][0].token_ids) == 200
    assert new.policy_version == 1
    assert [g[0].token_ids for g in new.completions] == reference.greedy(trained, PROMPTS)
    assert engine.full_weights == InstalledFullWeights("run_full", 1)
    assert engine.available_version(0, "run_full") == 1
    assert engine.available_version(1, "run_other") is None
    with pytest.raises(SlotChanged):
        await engine.generate(_job("run_other", 1))
    assert _pointers(engine) == before


async def test_a_failed_install_keeps_or_withdraws_the_version_as_the_error_says(
    engine: TorchEngine, reference: Reference
) -> None:
    first, last = reference.trained(seed=10), reference.trained(seed=11)
    loads: list[int] = []

    def loader(state: Mapping[str, torch.Tensor] | None, error: WeightsError | None = None):
        async def load(destination: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
            loads.append(len(destination))
            if state is not None:
                for name, tensor in list(destination.items())[:3]:
                    tensor.copy_(state[name])
            if error is not None:
                raise error
            assert state is not None
            for name, tensor in destination.items():
                tensor.copy_(state[name])
            return destination

        return load

    assert await engine.install_full(_event("run_full", 1), loader(first))
    with pytest.raises(WeightsError, match="header"):
        await engine.install_full(_event("run_full", 2), loader(None, WeightsError("bad header")))
    assert engine.full_weights == InstalledFullWeights("run_full", 1)
    assert _holds(engine, first)
    assert (await engine.generate(_job("run_full", 0))).policy_version == 1
    torn = WeightsError("digest mismatch", touched=True)
    with pytest.raises(WeightsError, match="digest mismatch"):
        await engine.install_full(_event("run_full", 3), loader(last, torn))
    assert engine.full_weights is not None and engine.full_weights.version is None
    assert "digest mismatch" in engine.full_weights.reason
    assert engine.available_version(0, "run_full") is None
    with pytest.raises(SlotChanged):
        await engine.generate(_job("run_full", 0))
    assert await engine.install_full(_event("run_full", 4), loader(last))
    assert engine.full_weights == InstalledFullWeights("run_full", 4)
    result = await engine.generate(_job("run_full", 0))
    assert result.policy_version == 4
    assert [g[0].token_ids for g in result.completions] == reference.greedy(last, PROMPTS)
    # An older version is not loaded at all.
    assert not await engine.install_full(_event("run_full", 2), loader(first))
    assert loads == [len(reference.base)] * 4
    # An adapter cannot go on top of a run's full weights.
    with pytest.raises(ValueError, match="served from full model weights"):
        await engine.load_adapter(0, _event("run_full", 5), {})


async def test_the_vllm_engine_refuses_full_weights_without_loading_them(
    tiny_dir: Path, tmp_path: Path
) -> None:
    engine = VllmEngine(
        tiny_dir, max_runs=1, max_lora_rank=8, output_dir=tmp_path, replica_name="full-test"
    )

    async def load(destination: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        raise AssertionError("nothing should be loaded")

    with pytest.raises(ValueError, match="the vllm engine cannot install full model weights"):
        await engine.install_full(_event("run_full", 1), load)
    assert engine.full_weights is None


async def test_an_adapter_prepared_for_a_slot_given_to_another_run_meanwhile_is_dropped(
    engine: TorchEngine, scratch_lora
) -> None:
    # A replica that starts while a slot changes hands (as these tests' runs take over indices
    # of earlier ones) may finish loading the old run's adapter after the new run got the slot.
    _, lora = scratch_lora
    adapter = random_adapter(lora, 0, 4, 8.0, seed=12)
    event = msgspec.structs.replace(_event("run_other", 1), kind=msgspec.UNSET)
    engine.remove_run(1, "run_other")
    engine.add_run(1, "run_next", 4, 8.0)
    assert not await engine.load_adapter(1, event, adapter)
    assert engine.available_version(1, "run_next") == 0
    assert engine.available_version(1, "run_other") is None
    assert (await engine.generate(_job("run_next", 1))).policy_version == 0
