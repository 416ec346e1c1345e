"""The trainer enforces each run's max_async_level itself: a batch sampled from a policy older
than the run allows is refused, reported and counted, and the run trains on once a batch of that
step within the bound arrives."""

from __future__ import annotations

import msgspec
from service_support import Cluster, eventually, progress_of, publish_batch, stream_events, submit
from trainer_support import make_batch, run_config

from schemas.events import InvalidMessage
from schemas.subjects import ERRORS_STREAM, errors_subject


async def _at_step(bus, step: int) -> bool:
    progress = await progress_of(bus, "run_a")
    return progress is not None and progress.step == step


async def test_a_batch_older_than_max_async_level_is_refused(own_nats, own_bus, tmp_path, tiny_dir):
    bus = own_bus
    cluster = await Cluster(own_nats.url, tmp_path / "out", tiny_dir).start()
    try:
        await submit(bus, "run_a", {**run_config(), "max_async_level": 1})
        for step in range(3):  # lag 1, the most the run allows
            batch = make_batch("run_a", step, num_samples=2)
            await publish_batch(
                bus, msgspec.structs.replace(batch, policy_version=max(0, step - 1))
            )
        await eventually(lambda: _at_step(bus, 3))
        stale = msgspec.structs.replace(make_batch("run_a", 3, num_samples=2), policy_version=1)
        await publish_batch(bus, stale)  # 2 versions behind
        reports = await eventually(
            lambda: stream_events(bus, ERRORS_STREAM, errors_subject("trainer"), InvalidMessage)
        )
        assert "policy version 1, 2 versions behind" in reports[-1].error
        assert "max_async_level = 1" in reports[-1].error
        assert cluster.trainer.intake.num_stale == 1
        assert (await progress_of(bus, "run_a")).step == 3
        fresh = msgspec.structs.replace(make_batch("run_a", 3, num_samples=2), policy_version=2)
        await publish_batch(bus, fresh, msg_id="run_a/rollouts/step_3/retry")
        await eventually(lambda: _at_step(bus, 4))
    finally:
        await cluster.close()
