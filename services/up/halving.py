"""Early stopping of a sweep by successive halving.

The rule (``[sweep.early_stop] after_steps = N, keep = f, window = w``): a run's score is its
mean reward over steps ``N-w .. N-1`` (the last ``w`` of its first ``N`` steps). Runs are judged
in cohorts: once some runs have ``N`` steps and no other admitted run of the sweep is still
short of ``N``, those runs are ranked by score and all but the best ``ceil(f * n)`` (at least
one) are evicted through the registry (``EvictRequested``, the rule as the reason). Their
indices go to the runs waiting in the registry's queue, which form the next cohort.

This departs from the textbook halving, which ranks every configuration at once: a sweep larger
than ``max_runs`` cannot train every run to step ``N`` before judging any, so each cohort is
ranked among itself. Ties keep the run whose id sorts first, so the rule is deterministic.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Mapping, Set

from services.bus import Bus
from services.up.sweep import EarlyStop

log = logging.getLogger(__name__)

REQUESTED_BY = "plexrl sweep (early stop)"


def score(rewards: list[float], rule: EarlyStop) -> float:
    """Mean reward over the last ``window`` of the first ``after_steps`` steps."""
    judged = rewards[: rule.after_steps][-rule.window :]
    return sum(judged) / len(judged)


def select_evictions(scores: Mapping[str, float], keep: float) -> list[str]:
    """The runs outside the best ``ceil(keep * n)`` (at least one kept), sorted by id."""
    kept = max(1, math.ceil(keep * len(scores)))
    ranked = sorted(scores, key=lambda run_id: (-scores[run_id], run_id))
    return sorted(ranked[kept:])


class Halving:
    """Which runs of a sweep to evict, and when; the state is the set of runs judged so far."""

    def __init__(self, rule: EarlyStop) -> None:
        self.rule = rule
        self.judged: set[str] = set()
        self.evicted: dict[str, str] = {}
        """run id -> the reason it was evicted with"""

    def decide(
        self, rewards: Mapping[str, list[float]], active: Set[str], finished: Set[str]
    ) -> dict[str, str]:
        """Runs to evict now (run id -> reason), given each run's rewards so far, the runs the
        registry holds active and the runs whose orchestrator has ended."""
        n = self.rule.after_steps
        open_runs = [r for r in rewards if r not in self.judged and r not in finished]
        ready = [r for r in open_runs if len(rewards[r]) >= n]
        behind = [r for r in open_runs if r in active and len(rewards[r]) < n]
        if not ready or behind:
            return {}
        self.judged.update(ready)
        scores = {r: score(rewards[r], self.rule) for r in ready}
        out = select_evictions(scores, self.rule.keep)
        if not out:
            return {}
        kept = len(ready) - len(out)
        cutoff = min(scores[r] for r in ready if r not in out)
        first = max(1, n - self.rule.window + 1)
        decided = {
            r: (
                f"sweep early stop (successive halving at step {n}, keep {self.rule.keep:g}): "
                f"mean reward over steps {first}-{n} {scores[r]:.3f}, below the {kept} best of "
                f"{len(ready)} (cut-off {cutoff:.3f})"
            )
            for r in out
        }
        self.evicted.update(decided)
        return decided


async def request_evictions(
    bus: Bus, decided: Mapping[str, str], requested_by: str = REQUESTED_BY
) -> None:
    """Ask the registry to evict each run, with its reason."""
    from schemas import subjects as sj
    from schemas.events import EvictRequested

    for run_id, reason in decided.items():
        log.info("%s: %s", run_id, reason)
        event = EvictRequested(run_id=run_id, reason=reason, requested_by=requested_by)
        await bus.publish(sj.EVICT, event, msg_id=f"{run_id}/evict/{uuid.uuid4().hex}")


async def active_runs(bus: Bus) -> set[str]:
    """Ids of the runs the registry holds with an index."""
    from schemas.subjects import KV_REGISTRY
    from services.runs.table import read_table

    records = await read_table(await bus.js.key_value(KV_REGISTRY))
    return {r.run_id for r in records.values() if r.status == "active"}
