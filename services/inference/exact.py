"""Requests of one exact version (``GenerateRequest.exact_version``): where a replica serves them.

A sampling client of saved weights ``run_x@4`` gets version 4 and nothing newer. The replica
serves such a request from a snapshot of that version (services/inference/snapshots.py):

1. a snapshot it already holds;
2. else, while the run's own slot is at that version, a copy of the slot, pinned (the first
   request of a sampling client usually comes while its version is the newest);
3. else, when the run has moved on, the version's announced weights fetched again from the
   weights stream and store (they keep a run's last few versions), pinned;
4. else an error that says why: the version was never published, or is no longer stored and
   this replica holds no snapshot of it.

A version not reached yet is waited for, as for any request. An engine without snapshot slots
serves the exact version from the run's slot while it holds it, and refuses it afterwards.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from schemas.events import GenerateRequest, WeightsReady
from services.bus import Bus
from services.inference.jobs import Engine, JobResult, job_of
from services.inference.progress import ProgressBeacon
from services.inference.requests import RequestFailed
from services.model.routing import NO_ADAPTER
from services.weights.announcements import announced
from services.weights.loader import WeightsError

Load = Callable[[WeightsReady, str], Awaitable[dict[str, Any]]]
"""``load(event, tenant)``: the adapter tensors an announcement names (the weights follower's)"""


class ExactVersions:
    """Finds or makes the snapshot that serves an exact-version request (module docstring)."""

    def __init__(self, bus: Bus, engine: Engine, load: Load) -> None:
        self.bus = bus
        self.engine = engine
        self.load = load

    async def slot(
        self, req: GenerateRequest, live_slot: int, live_version: int | None, owner: str
    ) -> int | None:
        """The slot that serves ``req``'s version now; None while it is still to come."""
        run_id, version = req.run_id, req.min_policy_version
        held = self.engine.snapshot_slot(run_id, version)
        if held is not None:
            return held
        if live_version is None or live_version < version:
            return None  # not published (or not loaded) yet: wait, as any request does
        if getattr(self.engine, "max_snapshots", 0) == 0:
            if live_version == version:
                return live_slot
            raise RequestFailed(
                f"{run_id}@{version}: this replica serves version {live_version} now and keeps "
                "no snapshots of older versions (--max-snapshots 0)"
            )
        if live_version == version:
            # None: the version is staged but not yet written into the slot; wait for it
            return await self.engine.pin(live_slot, run_id, version)
        event = await announced(self.bus, run_id, version, owner)
        if event is None:
            raise RequestFailed(
                f"{run_id}@{version} cannot be sampled any more: this replica holds no snapshot "
                "of it (its snapshots hold more recently used versions) and the weights stream "
                f"no longer announces it (the run is at version {live_version}); save the "
                "weights again to sample them"
            )
        try:
            tensors = await self.load(event, owner)
        except (WeightsError, ValueError) as exc:
            raise RequestFailed(
                f"{run_id}@{version} cannot be sampled any more: its weights are gone from the "
                "store (it keeps a run's newest versions only) and this replica holds no "
                f"snapshot of it; save the weights again to sample them ({exc})"
            ) from None
        pinned = await self.engine.pin(live_slot, run_id, version, event, tensors)
        if pinned is None:
            raise RequestFailed(f"{run_id}@{version}: this replica cannot keep a snapshot now")
        return pinned


async def base_generation(
    engine: Engine,
    replica: str,
    req: GenerateRequest,
    tenant: str,
    seed: int,
    beacon: ProgressBeacon | None,
) -> JobResult:
    """The base model's completions (no adapter, no run): version 0 of every run."""
    full = engine.full_weights
    if full is not None:
        raise RequestFailed(
            f"inference replica {replica} cannot serve the base model: its base "
            f"model carries the full weights of {full.run_id} (trained with --full-weights); "
            "send base-model requests to replicas that do not follow a full-weights trainer"
        )
    if beacon is not None:
        beacon.state = "generating"
    return await engine.generate(job_of(req, NO_ADAPTER, seed, tenant))
