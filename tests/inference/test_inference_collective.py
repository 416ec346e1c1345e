"""An inference replica with ``PLEXRL_WEIGHT_TRANSPORT=collective``: it joins the trainer's
broadcast group at start-up and serves the adapters that arrive through it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from inference_support import discover, lora_spec, random_adapter

from schemas.events import GenerateRequest, GenerateResponse
from schemas.subjects import GENERATE
from services.bus import Bus
from services.config import SettingsError, load_settings
from services.inference.cli import build_engine
from services.inference.service import InferenceService
from services.inference.settings import InferenceSettings
from services.model.sampling import SequenceSpec, generate_batch
from services.weights import WeightPublisher
from services.weights.collective import CollectiveSender

PROMPTS = [[1, 10, 11, 12], [1, 20]]


async def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_weight_transport_setting_comes_from_the_environment_or_a_flag(tmp_path: Path) -> None:
    def transport(environ: dict[str, str], **flags: str) -> str:
        overrides = {"model": tmp_path, **flags}
        return load_settings(InferenceSettings, None, overrides, environ).weight_transport

    env = {"PLEXRL_WEIGHT_TRANSPORT": "collective"}
    assert transport({}) == "object_store"
    assert transport(env) == "collective"
    assert transport(env, weight_transport="object_store") == "object_store"  # a flag wins
    with pytest.raises(SettingsError, match="weight_transport"):
        transport({"PLEXRL_WEIGHT_TRANSPORT": "carrier_pigeon"})


async def test_collective_replica_serves_an_adapter_broadcast_to_it(
    bus: Bus, nats_url: str, uid: str, tiny_dir: Path, tmp_path: Path, scratch_lora
) -> None:
    model, lora = scratch_lora
    settings = load_settings(
        InferenceSettings,
        overrides={"model": tiny_dir, "replica_name": f"replica-{uid}", "output_dir": tmp_path},
        environ={"PLEXRL_WEIGHT_TRANSPORT": "collective"},
    )
    # The trainer's side: a sender on the default group, as the replica's, and the publisher.
    sender = CollectiveSender(bus, "127.0.0.1", 0)
    publisher = WeightPublisher(bus, tmp_path, "collective", sender=sender)
    await publisher.start()
    replica_bus = await Bus.connect(nats_url, "inference")
    service = InferenceService(
        replica_bus,
        build_engine(settings),
        max_runs=settings.max_runs,
        replica_name=settings.replica_name,
        output_dir=settings.output_dir,
        weight_transport=settings.weight_transport,
    )
    await service.start()
    try:
        receiver = service.receiver
        assert receiver is not None
        generation = await receiver.joined(timeout=30.0)
        await _until(lambda: sender.members == [receiver.member_id])
        assert generation == sender.generation
        run_id = f"run_{uid}"
        await discover(bus, run_id, idx=1)
        adapter = random_adapter(lora, 1, 4, 8.0, seed=21)
        event = await publisher.publish(run_id, 1, 1, adapter, lora_spec())
        assert event.transport == "collective"
        assert event.location == (
            f"collective://127.0.0.1:{sender.port}/gen{generation}/{run_id}/step_1"
        )
        request = GenerateRequest(
            request_id=f"req-{uid}",
            run_id=run_id,
            prompts=PROMPTS,
            n=1,
            max_tokens=8,
            temperature=0.0,
            min_policy_version=1,
            timeout_s=30.0,
        )
        resp = await bus.request(GENERATE, request, GenerateResponse, timeout=40.0)
        assert resp.error is None and resp.policy_version == 1
        assert service.follower.tries[(run_id, 1)] == 1
        # The served adapter is the broadcast one: greedy decoding on a model holding it.
        for prompt, group in zip(PROMPTS, resp.completions, strict=True):
            spec = SequenceSpec(prompt, slot=1, max_tokens=8, temperature=0.0)
            (ref,) = generate_batch(model, lora, [spec], eos_ids=[2], pad_id=0)
            assert group[0].token_ids == ref.token_ids
    finally:
        await service.stop()
        await replica_bus.close()
        try:
            # A replica that stops leaves the group, which the sender ends.
            await _until(lambda: sender.members == [])
        finally:
            await publisher.close()
