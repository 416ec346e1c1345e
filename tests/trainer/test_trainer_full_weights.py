"""A full-weight trainer (``--full-weights``, one run): it trains the model's own parameters,
announces the whole model after each step, checkpoints and resumes it, refuses a KL run, and
gives a later run the base model again."""

from __future__ import annotations

import copy
import itertools
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from pydantic import ValidationError
from service_support import (
    Cluster,
    eventually,
    progress_of,
    publish_batch,
    stream_events,
    submit,
    weights_events,
)
from trainer_support import VOCAB, config, make_batch, run_config, same_tensors

from schemas.events import EvictRequested, RolloutBatch
from services.config import load_settings
from services.model.full import FullWeights, base_weight_files
from services.model.loader import load_model
from services.model.lora import NO_ADAPTER, MultiLoRA
from services.model.peft_io import FULL_WEIGHTS_FILE
from services.trainer.checkpoint import (
    complete_checkpoints,
    latest_checkpoint,
    read_step_log,
    save_checkpoint,
)
from services.trainer.loss import selected_logprobs
from services.trainer.settings import TrainerSettings
from services.trainer.state import RunSetupError, create_run_state
from services.trainer.step import StepExecutor
from services.weights import load_weights

REPO = Path(__file__).parents[2]
FULL = {"full_weights": True, "max_runs": 1}


def _base(model_dir: Path) -> dict[str, torch.Tensor]:
    model = load_model(model_dir)[0]
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _params(cluster: Cluster) -> dict[str, torch.Tensor]:
    """The trainer's parameters now (copies: the trainer goes on training the originals)."""
    assert cluster.trainer is not None
    return {k: t.clone() for k, t in cluster.trainer.lora.slot_state_dict(0).items()}


def _all_differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(not torch.equal(a[k], b[k]) for k in a)


async def _weights_at(bus, run_id: str, step: int):
    events = await weights_events(bus, run_id)
    return events if events and events[-1].step >= step else None


@pytest.fixture
async def full_cluster(own_nats, tmp_path, tiny_dir):
    c = await Cluster(own_nats.url, tmp_path / "out", tiny_dir, **FULL).start()
    yield c
    await c.close()


async def test_each_step_announces_the_whole_trained_model(full_cluster, own_bus, tiny_dir):
    bus, cluster = own_bus, full_cluster
    base = _base(tiny_dir)
    await submit(bus, "run_a", run_config(interval=2))
    for step in range(3):
        await publish_batch(bus, make_batch("run_a", step))
    events = await eventually(lambda: _weights_at(bus, "run_a", 3))

    assert [(e.step, e.kind, e.is_full) for e in events] == [
        (1, "full", True),
        (2, "full", True),
        (3, "full", True),
    ]
    latest = events[-1]
    assert (latest.idx, latest.transport, latest.lora.rank, latest.lora.alpha) == (
        0,
        "object_store",
        4,
        8.0,
    )
    # every parameter under its Hugging Face name (the tied lm_head once, as the embedding),
    # exactly as the trainer holds it after the step, and none of them the base any more
    published = await load_weights(bus, latest)
    assert set(published) == set(base) and "lm_head.weight" not in published
    assert same_tensors(published, _params(cluster))
    assert _all_differ(published, base)
    assert (await progress_of(bus, "run_a")).step == 3

    # the checkpoint (ckpt.interval = 2) holds the whole model, marked as such
    [(step, path)] = complete_checkpoints(cluster.out, "run_a")
    assert step == 2 and (path / FULL_WEIGHTS_FILE).is_file() and not (path / "adapter").exists()
    assert json.loads((path / "meta.json").read_text())["kind"] == "full"
    assert [(r["step"], r["weights"]) for r in read_step_log(cluster.out, "run_a")] == [
        (0, "full"),
        (1, "full"),
    ]


async def test_a_restarted_trainer_resumes_from_the_full_checkpoint(
    own_nats, own_bus, tmp_path, tiny_dir
):
    bus, out = own_bus, tmp_path / "out"
    first = await Cluster(own_nats.url, out, tiny_dir, **FULL).start()
    await submit(bus, "run_a", run_config(interval=1))
    for step in range(2):
        await publish_batch(bus, make_batch("run_a", step))
    await eventually(lambda: _weights_at(bus, "run_a", 2))
    trained = _params(first)
    moments = first.state("run_a").optimizer.state_dict()["state"]
    await first.close()

    second = await Cluster(own_nats.url, out, tiny_dir, **FULL).start()
    try:
        state = await eventually(lambda: _async(second.state("run_a")))
        assert (state.resumed_from, state.next_step) == (2, 2)
        assert same_tensors(_params(second), trained)
        resumed = state.optimizer.state_dict()["state"]
        assert resumed.keys() == moments.keys()
        assert all(torch.equal(resumed[i]["exp_avg"], moments[i]["exp_avg"]) for i in moments)
        await publish_batch(bus, make_batch("run_a", 2))
        events = await eventually(lambda: _weights_at(bus, "run_a", 3))
        assert same_tensors(await load_weights(bus, events[-1]), _params(second))
        assert _all_differ(_params(second), trained)
    finally:
        await second.close()


async def test_a_kl_run_is_refused_and_a_later_run_starts_from_the_base(
    full_cluster, own_bus, tiny_dir
):
    bus, cluster = own_bus, full_cluster
    trainer = cluster.trainer
    base = _base(tiny_dir)
    await submit(bus, "run_kl", run_config(kl_coef=0.1))
    [evict] = await eventually(lambda: _evictions(bus))
    assert (evict.run_id, evict.requested_by) == ("run_kl", "trainer")
    assert evict.reason == (
        "loss.kl_coef = 0.1 asks for a KL penalty against the base model, and this trainer "
        "trains the model's full weights (--full-weights), keeping no base model to compare "
        "with; resubmit the run with loss.kl_coef = 0, or train it on a LoRA trainer"
    )
    assert same_tensors(_params(cluster), base)

    # the slot is free again: run_a takes it and trains the model away from the base
    await submit(bus, "run_a", run_config())
    await publish_batch(bus, make_batch("run_a", 0))
    await eventually(lambda: _weights_at(bus, "run_a", 1))
    assert _all_differ(_params(cluster), base)

    # run_a's directory goes, the registry forgets it, and run_b gets the base model back
    shutil.rmtree(cluster.out / "run_a")
    await cluster.registry.scan()
    await eventually(lambda: _async(cluster.state("run_a") is None))
    await submit(bus, "run_b", run_config(seed=1))
    await eventually(lambda: _async(cluster.state("run_b")))
    assert same_tensors(_params(cluster), base)
    await publish_batch(bus, make_batch("run_b", 0))
    [event] = await eventually(lambda: weights_events(bus, "run_b"))
    assert (event.step, event.kind) == (1, "full")
    assert _all_differ(await load_weights(bus, event), base)
    assert list(trainer.states) == [0]


def test_full_weights_need_a_single_run_slot(tmp_path):
    with pytest.raises(ValidationError, match=r"needs max_runs = 1 \(got 2\)"):
        TrainerSettings(model=tmp_path, full_weights=True, max_runs=2)
    env = {"PLEXRL_FULL_WEIGHTS": "1", "PLEXRL_MAX_RUNS": "1"}
    assert load_settings(TrainerSettings, None, {"model": "m"}, environ=env).full_weights
    assert not TrainerSettings(model=tmp_path).full_weights
    flags = ["--model", str(tmp_path), "--full-weights", "--max-runs", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "services", "trainer", *flags],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 2
    assert "full_weights trains the model's own parameters for one run, so it needs " in (
        done.stderr
    )
    assert "max_runs = 1 (got 2)" in done.stderr


def test_a_checkpoint_is_only_loaded_by_a_trainer_of_its_kind(tiny_dir, tmp_path):
    model = load_model(tiny_dir)[0]
    full = FullWeights.attach(copy.deepcopy(model), tiny_dir)
    lora = MultiLoRA.attach(copy.deepcopy(model), n_adapters=1, max_rank=8)
    cfg = config(rank=4)
    for slots, run_id in ((full, "run_full"), (lora, "run_lora")):
        state = create_run_state(slots, 0, run_id, cfg, cfg.digest())
        save_checkpoint(tmp_path, run_id, state.to_checkpoint(slots), keep=1)
    full_ckpt = latest_checkpoint(tmp_path, "run_full")
    lora_ckpt = latest_checkpoint(tmp_path, "run_lora")
    assert full_ckpt is not None and lora_ckpt is not None
    assert (full_ckpt.kind, lora_ckpt.kind) == ("full", "lora")
    assert same_tensors(dict(full_ckpt.adapter), full.slot_state_dict(0))
    # rank 0 hands a checkpoint to the other ranks pickled: the tensors go, not the paths
    shipped = pickle.loads(pickle.dumps(full_ckpt))
    assert type(shipped.adapter) is dict
    assert same_tensors(shipped.adapter, full.slot_state_dict(0))

    with pytest.raises(
        RunSetupError,
        match=r"checkpoint step_0 holds the model's full weights but this trainer trains LoRA "
        r"adapters \(no --full-weights\); resume the run on a trainer that trains full weights",
    ):
        create_run_state(lora, 0, "run_full", cfg, cfg.digest(), full_ckpt)
    with pytest.raises(
        RunSetupError,
        match=r"checkpoint step_0 holds a LoRA adapter but this trainer trains full weights "
        r"\(--full-weights\); resume the run on a trainer that trains LoRA adapters",
    ):
        create_run_state(full, 0, "run_lora", cfg, cfg.digest(), lora_ckpt)


def test_full_weights_are_the_model_itself_with_no_base_beside_it(tiny_dir, tmp_path):
    model = load_model(tiny_dir)[0]
    full = FullWeights.attach(model, tiny_dir)
    params = full.slot_state_dict(0)
    assert list(params) == [n for n, _ in model.named_parameters()]
    assert all(p.requires_grad for p in full.slot_parameters(0))
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with full.use(torch.tensor([0, 0])):
            assert torch.equal(model(input_ids=ids).logits, plain)
    with (
        pytest.raises(ValueError, match="no row can run with the adapter off"),
        full.use([0, NO_ADAPTER]),
    ):
        pass

    # a state dict of another shape is refused before any parameter is written
    before = {k: t.clone() for k, t in params.items()}
    wrong = {k: torch.zeros_like(t) for k, t in params.items()}
    wrong["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \[3\]"):
        full.load_slot_state_dict(0, wrong, 4, 8.0)
    assert same_tensors(full.slot_state_dict(0), before)
    with pytest.raises(ValueError, match=r"has neither model\.safetensors nor"):
        base_weight_files(tmp_path)


def _completion_logprobs(full: FullWeights, batch: RolloutBatch) -> list[list[float]]:
    """Each completion's token log-probabilities under the model as it is now."""
    out = []
    for s in batch.samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad(), full.use([0]):
            logits = full.model(input_ids=ids).logits
        out.append(selected_logprobs(logits[:, :-1], ids[:, 1:], 1.0)[0, len(s.prompt_ids) - 1 :])
    return [t.tolist() for t in out]


def _mean(rows: list[list[float]]) -> float:
    return sum(map(sum, rows)) / sum(map(len, rows))


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_full_weight_steps_follow_the_advantage(tiny_dir, advantage):
    """Each step makes completions with a positive advantage more likely and those with a
    negative one less likely: the update descends the policy loss, it does not only move."""
    full = FullWeights.attach(copy.deepcopy(load_model(tiny_dir)[0]), tiny_dir)
    executor = StepExecutor(full.model, full, token_budget=128, pad_id=0, vocab_size=VOCAB)
    cfg = config(lr=1e-3)
    states = {0: create_run_state(full, 0, "run_full", cfg, cfg.digest())}
    batch = make_batch("run_full", 0, num_samples=4, advantage=advantage)
    means = []
    for step in range(3):
        # sampled by the model as it is (ratio 1: nothing clipped), then trained on
        now = _completion_logprobs(full, batch)
        means.append(_mean(now))
        samples = [
            msgspec.structs.replace(s, completion_logprobs=lp)
            for s, lp in zip(batch.samples, now, strict=True)
        ]
        on_policy = RolloutBatch(run_id="run_full", step=step, policy_version=step, samples=samples)
        [result] = executor.run([(0, on_policy)], states).runs.values()
        assert result.trained and result.stats.num_clipped == 0
        states[0].advance(result.num_tokens, result.num_samples, result.reward_mean)
    means.append(_mean(_completion_logprobs(full, batch)))
    steps = [b - a for a, b in itertools.pairwise(means)]
    if advantage > 0:
        assert all(d > 0 for d in steps), means
    else:
        assert all(d < 0 for d in steps), means


async def _async(value):
    return value


async def _evictions(bus) -> list[EvictRequested] | None:
    found = await stream_events(bus, "PLEXRL_RUNS", "plexrl.runs.evict", EvictRequested)
    return found or None
