"""Exact versions, the base model and prompt scores on a real nats-server and replica: a version
a request pinned is served after the run moves on, an older one comes back from the weights
store while it holds it, a dropped one fails saying why; the base model needs no run; a
response carries the prompt's scores and the alternatives asked for."""

from __future__ import annotations

from pathlib import Path

import torch
from inference_support import discover, lora_spec, random_adapter
from test_inference_service import _ask, _request

from services.bus import Bus
from services.model.sampling import SequenceSpec, generate_batch
from services.weights import WeightPublisher

PROMPT = [1, 10, 11, 12]


def _greedy(model, lora, slot: int) -> list[int]:
    spec = SequenceSpec(PROMPT, slot=slot, max_tokens=8, temperature=0.0)
    return generate_batch(model, lora, [spec], eos_ids=[2], pad_id=0)[0].token_ids


async def test_a_pinned_version_is_served_after_the_run_moves_on(
    bus: Bus, uid: str, start_replica, scratch_lora, tmp_path: Path
) -> None:
    model, lora = scratch_lora
    service = await start_replica(max_snapshots=1)
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=0)
    publisher = WeightPublisher(bus, tmp_path, keep_last=1)
    versions = {}
    for version, seed in ((1, 31), (2, 32), (3, 33)):
        adapter = random_adapter(lora, version, 4, 8.0, seed=seed)
        versions[version] = _greedy(model, lora, version)
        if version == 1:
            await publisher.publish(run_id, 0, 1, adapter, lora_spec())
            req = _request(run_id, prompts=[PROMPT], n=1, temperature=0.0, min_policy_version=1)
            first = await _ask(bus, msgspec_replace(req, exact_version=True))
            assert first.error is None and first.policy_version == 1
            assert first.completions[0][0].token_ids == versions[1]
        else:
            await publisher.publish(run_id, 0, version, adapter, lora_spec())
    assert len({tuple(v) for v in versions.values()}) == 3  # the versions generate differently

    at = {
        v: _request(run_id, prompts=[PROMPT], n=1, temperature=0.0, min_policy_version=v)
        for v in (1, 2, 3)
    }
    newest = await _ask(bus, at[3])
    assert newest.policy_version == 3 and newest.completions[0][0].token_ids == versions[3]
    # version 1 was pinned by its first request, and stays, though the store dropped it
    pinned = await _ask(bus, msgspec_replace(at[1], exact_version=True))
    assert pinned.error is None and pinned.policy_version == 1
    assert pinned.completions[0][0].token_ids == versions[1]
    # without exact_version, @1 is "1 or newer": the newest
    assert (await _ask(bus, at[1])).policy_version == 3
    # version 2 was never pinned and the store (keep_last=1) no longer has it: a clear error
    gone = await _ask(bus, msgspec_replace(at[2], exact_version=True))
    assert gone.completions == [] and gone.error is not None
    assert (
        f"{run_id}@2 cannot be sampled any more" in gone.error
        and "save the weights again" in gone.error
    )
    # version 3 is pinned from the slot; with one snapshot slot it replaces version 1
    assert (await _ask(bus, msgspec_replace(at[3], exact_version=True))).policy_version == 3
    assert service.engine.snapshots.dropped == [(run_id, 1)]
    # a new request (a copy of one answered already, same id and asks, gets the same answer)
    dropped = await _ask(bus, msgspec_replace(at[1], exact_version=True, request_id="after"))
    assert dropped.error is not None and f"{run_id}@1 cannot be sampled any more" in dropped.error


async def test_an_older_version_still_stored_is_fetched_and_pinned(
    bus: Bus, uid: str, start_replica, scratch_lora, tmp_path: Path
) -> None:
    model, lora = scratch_lora
    await start_replica(max_snapshots=2)
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=1)
    publisher = WeightPublisher(bus, tmp_path, keep_last=3)
    expected = {}
    for version in (1, 2):
        adapter = random_adapter(lora, version, 4, 8.0, seed=40 + version)
        expected[version] = _greedy(model, lora, version)
        await publisher.publish(run_id, 1, version, adapter, lora_spec())
    assert (await _ask(bus, _request(run_id, min_policy_version=2))).policy_version == 2
    req = _request(run_id, prompts=[PROMPT], n=1, temperature=0.0, min_policy_version=1)
    old = await _ask(bus, msgspec_replace(req, exact_version=True))
    assert old.error is None and old.policy_version == 1
    assert old.completions[0][0].token_ids == expected[1]


async def test_the_base_model_needs_no_run_and_prompts_are_scored(
    bus: Bus, uid: str, start_replica, scratch_lora, tiny_dir: Path
) -> None:
    model, lora = scratch_lora
    await start_replica()
    req = _request(
        f"run_label_{uid}", prompts=[PROMPT, [1, 20, 21]], n=2, max_tokens=3, temperature=1.0,
        base_model=True, prompt_logprobs=True, top_logprobs=2,
    )  # fmt: skip
    resp = await _ask(bus, req)
    assert resp.error is None and resp.policy_version == 0
    assert [len(g) for g in resp.completions] == [2, 2]
    assert len(resp.prompt_logprobs) == 2
    for prompt, scores, group in zip(
        req.prompts, resp.prompt_logprobs, resp.completions, strict=True
    ):
        with torch.inference_mode(), lora.use([-1]):
            logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        assert scores.logprobs[0] is None
        expected = [float(lp[t - 1, prompt[t]]) for t in range(1, len(prompt))]
        assert all(abs(a - b) < 1e-4 for a, b in zip(scores.logprobs[1:], expected, strict=True))
        assert scores.top_logprobs[1].token_ids == lp[0].topk(2).indices.tolist()
        for c in group:
            assert len(c.top_logprobs) == len(c.token_ids)
            assert all(len(t.token_ids) == 2 for t in c.top_logprobs)


def msgspec_replace(req, **changes):
    import msgspec

    return msgspec.structs.replace(req, **changes)
