"""Checkpoints (atomic, validated), the resume rule and the metrics lines."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from schemas.events import RolloutBatch, Sample
from services.orchestrator import state
from services.orchestrator.metrics import append_metrics, metrics_path, step_metrics
from services.orchestrator.state import (
    CheckpointError,
    OrchestratorCheckpoint,
    checkpoint_path,
    read_checkpoint,
    resume_step,
    write_checkpoint,
)

from .conftest import RUN
from .replica import read_metrics


def test_checkpoint_path_is_in_the_run_directory(tmp_path: Path) -> None:
    assert checkpoint_path(tmp_path, RUN) == tmp_path / RUN / "checkpoints" / "orchestrator.json"
    assert metrics_path(tmp_path, RUN) == tmp_path / RUN / "metrics.jsonl"
    with pytest.raises(ValueError, match="illegal run id"):
        checkpoint_path(tmp_path, "../etc")


def test_checkpoint_round_trip_and_no_temp_files_left(tmp_path: Path) -> None:
    path = checkpoint_path(tmp_path, RUN)
    assert read_checkpoint(path) is None
    ckpt = OrchestratorCheckpoint(run_id=RUN, next_step=3, next_prompt_index=24, incarnation=9)
    write_checkpoint(path, ckpt)
    write_checkpoint(path, OrchestratorCheckpoint(run_id=RUN, next_step=4, next_prompt_index=32))
    back = read_checkpoint(path)
    assert back is not None
    assert (back.run_id, back.next_step, back.next_prompt_index) == (RUN, 4, 32)
    assert back.updated_at > 0
    assert os.listdir(path.parent) == ["orchestrator.json"]
    assert json.loads(path.read_text())["next_step"] == 4  # plain JSON, any language reads it


def test_a_failed_write_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoint_path(tmp_path, RUN)
    write_checkpoint(path, OrchestratorCheckpoint(run_id=RUN, next_step=2, next_prompt_index=4))

    def crash(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state.os, "replace", crash)
    with pytest.raises(OSError):
        write_checkpoint(path, OrchestratorCheckpoint(run_id=RUN, next_step=3, next_prompt_index=6))
    monkeypatch.undo()
    back = read_checkpoint(path)
    assert back is not None and back.next_step == 2
    assert os.listdir(path.parent) == ["orchestrator.json"]  # the temporary file is gone


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"run_id": "run_orch"}',
        b'{"run_id": "run_orch", "next_step": -1, "next_prompt_index": 0}',
    ],
)
def test_a_damaged_checkpoint_is_an_error_that_says_what_to_do(
    tmp_path: Path, content: bytes
) -> None:
    path = checkpoint_path(tmp_path, RUN)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="delete it"):
        read_checkpoint(path)


@pytest.mark.parametrize(
    ("checkpoint", "trainer", "stream", "expected"),
    [
        (None, None, None, 0),  # a new run
        (3, None, None, 3),
        (3, 3, 2, 3),  # all agree: steps 0..2 exist
        (2, None, 2, 3),  # killed after publishing step 2, before checkpointing it
        (None, 5, None, 5),  # checkpoint lost, stream expired: the trainer has 0..4
        (1, 4, 6, 7),  # the furthest witness wins
        (0, 0, 0, 1),
    ],
)
def test_resume_step_takes_the_furthest_witness(
    checkpoint: int | None, trainer: int | None, stream: int | None, expected: int
) -> None:
    assert resume_step(checkpoint, trainer, stream) == expected


def _batch(step: int, version: int, rewards: list[float], lengths: list[int]) -> RolloutBatch:
    samples = [
        Sample(
            prompt_ids=[1, 5],
            completion_ids=[7] * n,
            completion_logprobs=[-0.1] * n,
            reward=r,
            advantage=0.0,
        )
        for r, n in zip(rewards, lengths, strict=True)
    ]
    return RolloutBatch(run_id=RUN, step=step, policy_version=version, samples=samples)


def test_step_metrics_values() -> None:
    batch = _batch(5, 4, [1.0, 0.0, 0.5, 0.5], [2, 4, 4, 6])
    m = step_metrics(
        batch, num_truncated=1, generation_s=2.0, wait_s=0.5, step_s=3.0, retries=2, now=100.0
    )
    assert (m.step, m.policy_version, m.policy_lag) == (5, 4, 1)
    assert m.reward_mean == 0.5
    assert m.reward_std == pytest.approx(0.353553, abs=1e-6)
    assert m.completion_len_mean == 4.0
    assert m.truncated_frac == 0.25
    assert m.num_samples == 4
    assert m.tokens_per_s == 8.0  # 16 tokens in 2 s
    assert (m.wait_s, m.step_s, m.retries, m.time) == (0.5, 3.0, 2, 100.0)


def test_metrics_lines_append_and_read_back_last_per_step(tmp_path: Path) -> None:
    path = metrics_path(tmp_path, RUN)
    for step, reward in ((0, 0.1), (1, 0.2), (1, 0.3)):  # step 1 republished after a crash
        batch = _batch(step, 0, [reward, reward], [1, 1])
        append_metrics(
            path,
            step_metrics(
                batch, num_truncated=0, generation_s=1.0, wait_s=0, step_s=1, retries=0, now=1
            ),
        )
    with path.open("a") as f:
        f.write('{"step": 2, "reward_me')  # a line cut by a crash
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    first = json.loads(lines[0])
    assert {"step", "reward_mean", "policy_lag"} <= first.keys()
    assert (first["step"], first["reward_mean"], first["policy_lag"]) == (0, 0.1, 0)
    rows = read_metrics(path)
    assert [(r["step"], r["reward_mean"]) for r in rows] == [(0, 0.1), (1, 0.3)]
    assert read_metrics(tmp_path / "missing.jsonl") == []
