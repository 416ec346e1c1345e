"""The diagnostics of a step's metrics line (entropy, zero-spread groups) and the in-place
merge of an evaluation into the line of its step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.events import RolloutBatch, Sample
from services.orchestrator.metrics import (
    append_metrics,
    merge_metrics,
    metrics_path,
    reward_groups,
    step_metrics,
)

from .conftest import RUN
from .replica import read_metrics


def _batch(
    groups: list[tuple[list[int], list[float]]], logprobs: list[list[float]]
) -> RolloutBatch:
    samples = []
    it = iter(logprobs)
    for prompt, rewards in groups:
        for r in rewards:
            lps = next(it)
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    completion_ids=[5] * len(lps),
                    completion_logprobs=lps,
                    reward=r,
                    advantage=0.0,
                )
            )
    return RolloutBatch(run_id=RUN, step=2, policy_version=1, samples=samples)


def _metrics(batch: RolloutBatch, group_size: int | None = None) -> object:
    return step_metrics(
        batch,
        num_truncated=0,
        generation_s=1.0,
        wait_s=0.0,
        step_s=1.0,
        retries=0,
        now=1.0,
        group_size=group_size,
    )


def test_entropy_is_the_mean_negative_logprob_of_the_sampled_tokens() -> None:
    batch = _batch(
        [([1, 2], [0.0, 1.0]), ([1, 3], [0.5, 0.5])],
        [[-0.5, -1.5], [-1.0], [-2.0, -0.0, -1.0], []],
    )
    m = _metrics(batch)
    assert m.entropy_mean == pytest.approx(6.0 / 6)  # type: ignore[attr-defined]
    assert m.zero_spread_frac == 0.5  # type: ignore[attr-defined]
    greedy = _batch([([1], [1.0, 1.0])], [[0.0, 0.0], [0.0]])
    assert _metrics(greedy).entropy_mean == 0.0  # type: ignore[attr-defined]


def test_groups_come_from_the_group_size_or_from_the_prompts() -> None:
    # two equal prompts side by side: the prompts alone merge them, the group size does not
    batch = _batch(
        [([7], [0.0, 0.0]), ([7], [1.0, 1.0]), ([8], [0.2, 0.4])],
        [[-1.0]] * 6,
    )
    assert reward_groups(batch, 2) == [[0.0, 0.0], [1.0, 1.0], [0.2, 0.4]]
    assert reward_groups(batch) == [[0.0, 0.0, 1.0, 1.0], [0.2, 0.4]]
    assert _metrics(batch, 2).zero_spread_frac == pytest.approx(2 / 3)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="6 samples do not split into groups of 4"):
        reward_groups(batch, 4)


def test_merge_adds_fields_to_the_last_line_of_the_step(tmp_path: Path) -> None:
    path = metrics_path(tmp_path, RUN)
    batch = _batch([([1], [0.0, 1.0])], [[-1.0], [-1.0]])
    for step in (0, 1, 1, 2):
        append_metrics(path, _metrics_at(batch, step))
    with path.open("a") as f:
        f.write('{"step": 3, "rew')  # a line cut by a crash
    merge_metrics(path, 1, {"heldout_greedy": 0.75, "base_best": 0.5, "step": 99})
    lines = path.read_text().splitlines()
    assert len(lines) == 5  # nothing added, nothing lost
    assert "heldout_greedy" not in json.loads(lines[1])  # the earlier copy of step 1
    assert json.loads(lines[2])["heldout_greedy"] == 0.75
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert (rows[1]["heldout_greedy"], rows[1]["base_best"], rows[1]["step"]) == (0.75, 0.5, 1)
    assert rows[1]["reward_mean"] == 0.5
    merge_metrics(path, 7, {"heldout_greedy": 0.1})  # a step without a line gets one
    assert read_metrics(path)[-1] == {"step": 7, "heldout_greedy": 0.1}
    assert not list(tmp_path.rglob("*.tmp"))


def _metrics_at(batch: RolloutBatch, step: int):  # type: ignore[no-untyped-def]
    stepped = RolloutBatch(run_id=batch.run_id, step=step, policy_version=0, samples=batch.samples)
    return _metrics(stepped)
