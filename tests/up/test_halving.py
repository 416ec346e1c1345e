"""Successive halving: which runs a sweep's early-stop rule evicts, and when it judges them."""

from __future__ import annotations

from services.up.halving import Halving, score, select_evictions
from services.up.sweep import EarlyStop

RULE = EarlyStop(after_steps=4, keep=0.5, window=2)


def test_the_bottom_half_is_evicted_and_ties_keep_the_first_id() -> None:
    scores = {"run_a": 0.5, "run_b": 0.9, "run_c": 0.1, "run_d": 0.7}
    assert select_evictions(scores, 0.5) == ["run_a", "run_c"]
    assert select_evictions({"run_b": 0.3, "run_a": 0.3}, 0.5) == ["run_b"]
    assert select_evictions({"run_a": 0.3, "run_b": 0.2, "run_c": 0.1}, 0.5) == ["run_c"]  # keeps 2
    assert select_evictions({"run_a": 0.0}, 0.25) == []  # at least one run goes on


def test_score_is_the_window_before_the_judging_step() -> None:
    # steps after after_steps do not count: the rule judges every run at the same step
    assert score([0.0, 0.2, 0.4, 0.6, 1.0, 1.0], RULE) == 0.5


def test_a_cohort_is_judged_once_no_admitted_run_is_behind() -> None:
    h = Halving(RULE)
    rewards = {"run_a": [0.1] * 4, "run_b": [0.9] * 3, "run_c": [0.5] * 5, "run_w": []}
    active = {"run_a", "run_b", "run_c"}  # run_w waits in the registry's queue
    assert h.decide(rewards, active, finished=set()) == {}  # run_b is still short of step 4
    rewards["run_b"].append(0.9)
    decided = h.decide(rewards, active, finished=set())
    assert list(decided) == ["run_a"]  # 3 judged, the best 2 go on
    assert "successive halving at step 4" in decided["run_a"]
    assert "0.100" in decided["run_a"] and "cut-off 0.500" in decided["run_a"]
    assert h.decide(rewards, active, finished=set()) == {}  # judged once
    # run_a's index went to run_w, which is judged when it reaches step 4, alone: kept
    rewards["run_w"] = [0.0] * 4
    assert h.decide(rewards, {"run_b", "run_c", "run_w"}, finished=set()) == {}
    assert h.judged == {"run_a", "run_b", "run_c", "run_w"}
    assert h.evicted == decided


def test_finished_runs_are_not_judged() -> None:
    h = Halving(RULE)
    rewards = {"run_a": [0.1] * 4, "run_b": [0.9] * 4}
    assert h.decide(rewards, {"run_b"}, finished={"run_a"}) == {}
