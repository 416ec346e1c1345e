"""Training commands through a real NATS server, registry and trainer: forward_backward and
optim_step train a commands run, retries are not applied twice, runs share passes, saves
publish and restore, and every bad request gets a clear error with nothing applied."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from service_support import (
    Cluster,
    eventually,
    progress_of,
    stream_events,
    submit,
    weights_events,
)
from trainer_support import run_config

from schemas.training import (
    AdamParams,
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoadWeightsRequest,
    LoadWeightsResult,
    OptimStepRequest,
    OptimStepResult,
    SaveWeightsRequest,
    SaveWeightsResult,
    train_subject,
)
from services.bus import Bus

FB = train_subject("forward_backward")
OPT = train_subject("optim_step")


@pytest.fixture
async def cluster(own_nats, tmp_path, tiny_dir):
    c = await Cluster(own_nats.url, tmp_path / "out", tiny_dir, collect_ms=100.0).start()
    yield c
    await c.close()


def _data(seed: int = 0) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    data = []
    for n in (7, 9, 5):
        tokens = torch.randint(3, 40, (n + 1,), generator=g).tolist()
        data.append(
            Datum(
                model_input=tokens[:-1],
                loss_fn_inputs={"target_tokens": [float(t) for t in tokens[1:]]},
            )
        )
    return data


def _commands_config(**kw) -> dict:
    return {**run_config(**kw), "driver": "commands"}


async def _fb(bus: Bus, run_id: str, rid: str, **kw) -> ForwardBackwardResult:
    req = ForwardBackwardRequest(request_id=rid, run_id=run_id, data=kw.pop("data", _data()), **kw)
    return await bus.request(FB, req, ForwardBackwardResult, timeout=30.0)


async def _step(bus: Bus, run_id: str, rid: str, lr: float = 0.02) -> OptimStepResult:
    req = OptimStepRequest(
        request_id=rid, run_id=run_id, adam_params=AdamParams(learning_rate=lr, grad_clip_norm=1.0)
    )
    return await bus.request(OPT, req, OptimStepResult, timeout=30.0)


async def _ready(cluster: Cluster, *run_ids: str) -> None:
    await eventually(lambda: _all_there(cluster, run_ids))


async def _all_there(cluster: Cluster, run_ids) -> bool:
    return all(cluster.state(r) is not None for r in run_ids)


async def test_supervised_steps_lower_the_loss_and_retries_apply_once(cluster, own_bus):
    bus = own_bus
    await submit(bus, "run_c", _commands_config())
    await _ready(cluster, "run_c")
    losses = []
    for i in range(6):
        fb = await _fb(bus, "run_c", f"fb-{i}")
        assert fb.error is None, fb.error
        assert fb.step == i and len(fb.loss_fn_outputs) == 3
        assert [len(o["logprobs"]) for o in fb.loss_fn_outputs] == [7, 9, 5]
        assert fb.metrics["loss:sum"] == pytest.approx(
            -sum(sum(o["logprobs"]) for o in fb.loss_fn_outputs), rel=1e-5
        )
        losses.append(fb.metrics["loss:sum"])
        step = await _step(bus, "run_c", f"opt-{i}")
        assert step.error is None and step.step == i + 1 and step.metrics["applied"] == 1
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < 0.9 * losses[0], losses

    # The same request ids again: the stored results, nothing applied a second time.
    again = await _step(bus, "run_c", "opt-5")
    assert again == step
    assert (await _fb(bus, "run_c", "fb-5")).metrics == fb.metrics
    assert cluster.state("run_c").progress.step == 6
    progress = await eventually(lambda: _progress_at(bus, "run_c", 6))
    assert progress.total_tokens == 6 * 21 and progress.total_samples == 6 * 3
    # forward_only looks without accumulating: the next step applies no request
    peek = await _fb(bus, "run_c", "peek", forward_only=True)
    assert peek.error is None and peek.metrics["loss:sum"] < losses[0]
    assert (await _step(bus, "run_c", "opt-empty")).metrics["applied"] == 0


async def _invalid_reports(bus: Bus) -> list:
    from schemas.events import InvalidMessage
    from schemas.subjects import ERRORS_STREAM, errors_subject

    return await stream_events(bus, ERRORS_STREAM, errors_subject("trainer"), InvalidMessage)


async def _progress_at(bus, run_id, step):
    progress = await progress_of(bus, run_id)
    return progress if progress is not None and progress.step == step else None


async def test_runs_share_passes_and_saves_publish_and_restore(cluster, own_bus, tmp_path):
    bus = own_bus
    await submit(bus, "run_c", _commands_config())
    await submit(bus, "run_d", _commands_config(rank=2, alpha=4.0))
    await _ready(cluster, "run_c", "run_d")
    c, d = await asyncio.gather(_fb(bus, "run_c", "c0"), _fb(bus, "run_d", "d0", data=_data(1)))
    assert c.error is None and d.error is None
    assert c.metrics["runs_in_pass:max"] == d.metrics["runs_in_pass:max"] == 2
    assert cluster.trainer.commands.shared_passes >= 1
    await asyncio.gather(_step(bus, "run_c", "c-opt0"), _step(bus, "run_d", "d-opt0"))

    saved = await bus.request(
        train_subject("save_weights"),
        SaveWeightsRequest(request_id="s1", run_id="run_c", kind="sampler"),
        SaveWeightsResult,
        timeout=30.0,
    )
    assert saved.error is None and saved.path == "run_c@1" and saved.step == 1
    events = await eventually(lambda: weights_events(bus, "run_c"))
    assert events[-1].step == 1

    state = await bus.request(
        train_subject("save_weights"),
        SaveWeightsRequest(request_id="s2", run_id="run_c", kind="state", name="mine"),
        SaveWeightsResult,
        timeout=30.0,
    )
    assert state.error is None and state.path == "mine"
    lora = cluster.trainer.lora
    idx = cluster.state("run_c").idx
    before = lora.slot_state_dict(idx)
    await _fb(bus, "run_c", "c1")
    assert (await _step(bus, "run_c", "c-opt1")).step == 2
    assert any(not torch.equal(before[k], v) for k, v in lora.slot_state_dict(idx).items())
    loaded = await bus.request(
        train_subject("load_weights"),
        LoadWeightsRequest(request_id="l1", run_id="run_c", path="mine"),
        LoadWeightsResult,
        timeout=30.0,
    )
    assert loaded.error is None and loaded.step == 1
    after = lora.slot_state_dict(idx)
    assert all(torch.equal(before[k], after[k]) for k in before)


async def test_bad_commands_get_clear_errors_and_change_nothing(cluster, own_bus):
    bus = own_bus
    await submit(bus, "run_c", _commands_config())
    await submit(bus, "run_r", run_config())
    await _ready(cluster, "run_c", "run_r")
    idx = cluster.state("run_c").idx
    before = cluster.trainer.lora.slot_state_dict(idx)

    cases = {
        "unknown run run_nope": await _fb(bus, "run_nope", "x1"),
        "driver = 'commands'": await _fb(bus, "run_r", "x2"),
        "loss_fn 'dro' is not supported": await _fb(bus, "run_c", "x3", loss_fn="dro"),
        "needs loss_fn_inputs['logprobs']": await _fb(
            bus, "run_c", "x4", loss_fn="importance_sampling"
        ),
    }
    for message, result in cases.items():
        assert result.error is not None and message in result.error, (message, result.error)
        assert result.loss_fn_outputs == []
    # Another tenant's subject for the default tenant's run
    other = await bus.request(
        train_subject("forward_backward", "acme"),
        ForwardBackwardRequest(request_id="x5", run_id="run_c", data=_data()),
        ForwardBackwardResult,
        timeout=30.0,
    )
    assert other.error == "run_c does not belong to tenant acme"
    reports = await eventually(lambda: _invalid_reports(bus))
    assert any("does not belong to tenant acme" in r.error for r in reports)
    # Bytes that are no request: an answer naming what was wrong, with the id it could read
    msg = await bus.nc.request(
        FB, b'{"request_id": "x6", "run_id": "run_c", "data": 3}', timeout=30
    )
    from schemas.codec import decode

    broken = decode(msg.data, ForwardBackwardResult)
    assert broken.request_id == "x6" and broken.run_id == "run_c"
    assert broken.error is not None and broken.error.startswith("invalid ForwardBackwardRequest")
    reserved = await bus.request(
        train_subject("save_weights"),
        SaveWeightsRequest(request_id="x7", run_id="run_c", kind="state", name="step_3"),
        SaveWeightsResult,
        timeout=30.0,
    )
    assert reserved.error is not None and "reserved" in reserved.error
    missing = await bus.request(
        train_subject("load_weights"),
        LoadWeightsRequest(request_id="x8", run_id="run_c", path=".."),
        LoadWeightsResult,
        timeout=30.0,
    )
    assert missing.error is not None and "no complete checkpoint" in missing.error

    # Nothing of the above reached the run: the next step applies no request at all.
    step = await _step(bus, "run_c", "x9")
    assert step.error is None and step.metrics["applied"] == 0
    after = cluster.trainer.lora.slot_state_dict(idx)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert cluster.state("run_r").progress.step == 0
