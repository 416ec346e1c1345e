"""Inference and trainer agree on the policy, through the real services.

``plexrl up`` trains one run sampled at temperature 0.7, keeping its trained batches
(``PLEXRL_ROLLOUTS_KEEP_HISTORY``) and a checkpoint of every step. Afterwards the rollouts
stream holds every RolloutBatch with the log-probabilities inference reported for each
completion token. For the batches sampled from policy version 0 (the base model: a fresh
adapter has B = 0) and for those sampled from trained versions (the adapter checkpointed at that
step), the trainer's forward of the same tokens at the same temperature gives the same numbers
to 1e-4: inference serves the adapter the trainer trained, not the base model. And every step
the trainer trained at lag 0 has an importance ratio of 1 (within 1e-3): the trainer scores
tokens under the distribution they were drawn from.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from up_support import run_up_one_run

from schemas.codec import decode
from schemas.config import dump_toml
from schemas.events import RolloutBatch
from schemas.subjects import ROLLOUTS_STREAM
from services.bus import Bus, EmbeddedNats
from services.model.loader import load_model
from services.model.lora import MultiLoRA
from services.model.tiny import build_tiny_model
from services.trainer.checkpoint import complete_checkpoints, load_checkpoint
from services.trainer.loss import selected_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TEMPERATURE = 0.7


async def _batches(store: Path) -> list[RolloutBatch]:
    with EmbeddedNats(store_dir=store) as server:
        bus = await Bus.connect(server.url, "test")
        try:
            info = await bus.js.stream_info(ROLLOUTS_STREAM)
            out = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                raw = await bus.js.get_msg(ROLLOUTS_STREAM, seq)
                out.append(decode(raw.data or b"", RolloutBatch))
            return out
        finally:
            await bus.close()


def test_inference_logprobs_equal_the_trainers_forward(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    config = tmp_path / "up.toml"
    config.write_text(
        dump_toml(
            {
                "steps": 6,
                "envs": ["reverse"],
                "run": {
                    "sampling": {"temperature": TEMPERATURE},
                    "max_async_level": 1,
                    # the adapter of every version, to score its batches with
                    "ckpt": {"interval": 1, "keep": 10},
                },
            }
        )
    )
    # the trainer keeps the batches it trained, for this comparison (it purges them by default)
    up = run_up_one_run(
        tmp_path / "out",
        "--model",
        str(model_dir),
        "--config",
        str(config),
        env={"PLEXRL_ROLLOUTS_KEEP_HISTORY": "1"},
    )
    lag0 = [t for t in up.trained if t["batch_policy_version"] == t["step"]]
    assert lag0, up.trained
    for t in lag0:
        assert t["ratio_mean"] == pytest.approx(1.0, abs=1e-3), t

    batches = asyncio.run(_batches(tmp_path / "out" / "nats"))
    base = [b for b in batches if b.policy_version == 0]
    assert base and all(s.completion_ids for b in base for s in b.samples)
    model, _ = load_model(model_dir)
    assert _compare(model, base) > 50

    # trained versions: each batch scored with the adapter of the version it was sampled from
    saved = dict(complete_checkpoints(up.out, up.run_dir.name))
    trained = sorted({b.policy_version for b in batches} - {0})
    assert len(trained) >= 2 and set(trained) <= set(saved), (trained, sorted(saved))
    adapters = {version: load_checkpoint(saved[version]) for version in trained}
    lora = MultiLoRA.attach(model, n_adapters=1, max_rank=max(c.rank for c in adapters.values()))
    for version, ckpt in adapters.items():
        lora.load_slot_state_dict(0, ckpt.adapter, ckpt.rank, ckpt.alpha)
        with lora.use([0]):
            assert _compare(model, [b for b in batches if b.policy_version == version]) > 10


def _compare(model, batches: list[RolloutBatch]) -> int:
    """Assert that the model gives each completion token the log-probability inference
    reported; the number of tokens compared."""
    compared = 0
    for batch in batches:
        for sample in batch.samples:
            ids = [*sample.prompt_ids, *sample.completion_ids]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids[:-1]])).logits
                lp = selected_logprobs(logits, torch.tensor([ids[1:]]), temperature=TEMPERATURE)
            trainer = lp[0, len(sample.prompt_ids) - 1 :].tolist()
            assert trainer == pytest.approx(sample.completion_logprobs, abs=1e-4)
            compared += len(trainer)
    return compared
