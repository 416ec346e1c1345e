"""Checkpoints: atomic, complete or absent, and a resumed run continues exactly where it was."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_support import Parts, config, make_batch, same_tensors

from services.trainer.checkpoint import (
    MARKER,
    append_step_log,
    checkpoints_dir,
    complete_checkpoints,
    latest_checkpoint,
    read_step_log,
    recover_step_log,
    remove_partials,
    save_checkpoint,
)
from services.trainer.state import RunSetupError


def _same_optimizer_state(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for key, entry in a["state"].items():
        other = b["state"][key]
        if entry.keys() != other.keys():
            return False
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                if not torch.equal(value, other[name]):
                    return False
            elif value != other[name]:
                return False
    return True


def test_resumed_run_equals_the_saved_one_and_continues_identically(tiny_dir, tmp_path):
    cfg = config(rank=4, lr=1e-2, interval=2)
    original = Parts(tiny_dir)
    state = original.add_run(1, "run_a", cfg)
    for step in range(2):
        original.step({1: make_batch("run_a", step)})
    assert state.checkpoint_due()
    path = save_checkpoint(tmp_path, "run_a", state.to_checkpoint(original.lora), keep=2)
    assert path == tmp_path / "run_a" / "checkpoints" / "step_2"
    assert sorted(p.name for p in path.iterdir()) == [
        MARKER,
        "adapter",
        "meta.json",
        "optimizer.pt",
        "progress.json",
        "scheduler.pt",
    ]
    assert sorted(p.name for p in (path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    # A new trainer (another model instance, another slot) resumes from the checkpoint.
    resumed_parts = Parts(tiny_dir)
    ckpt = latest_checkpoint(tmp_path, "run_a")
    assert ckpt is not None and ckpt.step == 2
    resumed = resumed_parts.add_run(0, "run_a", cfg, ckpt)
    assert (resumed.committed_step, resumed.resumed_from, resumed.next_step) == (2, 2, 2)
    assert resumed.progress == state.progress
    assert same_tensors(resumed_parts.adapter(0), original.adapter(1))
    assert _same_optimizer_state(resumed.optimizer.state_dict(), state.optimizer.state_dict())
    assert resumed.scheduler.state_dict() == state.scheduler.state_dict()

    # The next step gives bit-identical adapters on both.
    batch = make_batch("run_a", 2)
    original.step({1: batch})
    resumed_parts.step({0: batch})
    assert same_tensors(resumed_parts.adapter(0), original.adapter(1))
    assert resumed.progress == state.progress and resumed.progress.step == 3


def test_incomplete_checkpoints_are_never_loaded(tiny_dir, tmp_path):
    parts = Parts(tiny_dir)
    state = parts.add_run(0, "run_a", config())
    save_checkpoint(tmp_path, "run_a", state.to_checkpoint(parts.lora), keep=5)
    parts.step({0: make_batch("run_a", 0)})
    newest = save_checkpoint(tmp_path, "run_a", state.to_checkpoint(parts.lora), keep=5)
    # A crash before the marker: a step directory without COMPLETE, and a hidden staging dir.
    (newest / MARKER).unlink()
    staging = checkpoints_dir(tmp_path, "run_a") / ".step_7.partial-x"
    staging.mkdir()
    assert [s for s, _ in complete_checkpoints(tmp_path, "run_a")] == [0]
    ckpt = latest_checkpoint(tmp_path, "run_a")
    assert ckpt is not None and ckpt.step == 0
    assert remove_partials(tmp_path, "run_a") == 2
    assert sorted(p.name for p in checkpoints_dir(tmp_path, "run_a").iterdir()) == ["step_0"]


def test_unreadable_newest_checkpoint_falls_back_to_an_older_one(tiny_dir, tmp_path):
    parts = Parts(tiny_dir)
    state = parts.add_run(0, "run_a", config())
    for step in range(2):
        parts.step({0: make_batch("run_a", step)})
        save_checkpoint(tmp_path, "run_a", state.to_checkpoint(parts.lora), keep=5)
    (checkpoints_dir(tmp_path, "run_a") / "step_2" / "optimizer.pt").write_bytes(b"garbage")
    ckpt = latest_checkpoint(tmp_path, "run_a")
    assert ckpt is not None and ckpt.step == 1


def test_keep_prunes_old_checkpoints(tiny_dir, tmp_path):
    parts = Parts(tiny_dir)
    state = parts.add_run(0, "run_a", config())
    for step in range(4):
        parts.step({0: make_batch("run_a", step)})
        save_checkpoint(tmp_path, "run_a", state.to_checkpoint(parts.lora), keep=2)
    assert [s for s, _ in complete_checkpoints(tmp_path, "run_a")] == [3, 4]


def test_a_checkpoint_of_another_rank_is_refused(tiny_dir, tmp_path):
    parts = Parts(tiny_dir)
    state = parts.add_run(0, "run_a", config(rank=4))
    save_checkpoint(tmp_path, "run_a", state.to_checkpoint(parts.lora), keep=2)
    ckpt = latest_checkpoint(tmp_path, "run_a")
    with pytest.raises(RunSetupError, match="rank-4 adapter but the run's config asks for rank 2"):
        Parts(tiny_dir).add_run(0, "run_a", config(rank=2), ckpt)


def test_step_log_recovery_adds_exactly_the_committed_steps_it_lacks(tmp_path):
    append_step_log(tmp_path, "run_a", [{"run_id": "run_a", "step": s} for s in range(3)])
    # the checkpoint holds 5 steps (batch steps 0..4) but the crash came before the append
    assert recover_step_log(tmp_path, "run_a", committed_steps=5) == [3, 4]
    assert recover_step_log(tmp_path, "run_a", committed_steps=5) == []
    records = read_step_log(tmp_path, "run_a")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r.get("recovered", False) for r in records] == [False] * 3 + [True] * 2
    # a torn last line (a crash mid-append) is ignored, not fatal
    with open(tmp_path / "run_a" / "trainer_steps.jsonl", "a") as f:
        f.write(json.dumps({"step": 5})[:5])
    assert len(read_step_log(tmp_path, "run_a")) == 5
