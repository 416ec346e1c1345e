"""The rollout intake on a real stream: what is trained, held, skipped, handed back, dropped."""

from __future__ import annotations

import asyncio

from service_support import publish_batch
from trainer_support import make_batch

from schemas.events import RolloutBatch
from schemas.subjects import ROLLOUTS_STREAM, ROLLOUTS_WILDCARD
from services.bus import Consumer, flushed
from services.trainer.intake import Intake, RunSteps


def _consumer(bus, name: str = "trainer") -> Consumer[RolloutBatch]:
    return Consumer(
        bus,
        stream=ROLLOUTS_STREAM,
        durable=name,
        filter_subject=ROLLOUTS_WILDCARD,
        event_type=RolloutBatch,
        ack_wait=30.0,
    )


async def _fill(intake: Intake, expected: int) -> None:
    for _ in range(40):
        for batch, delivery in await intake.consumer.fetch(batch=64, timeout=0.25):
            await intake.add(batch, delivery)
        if sum(len(s) for s in intake.pending.values()) >= expected:
            return
    raise AssertionError(f"expected {expected} pending batches, have {intake.pending}")


async def _ack_pending(bus) -> int:
    await flushed(bus.nc)
    return (await bus.js.consumer_info(ROLLOUTS_STREAM, "trainer")).num_ack_pending


async def test_batches_are_placed_by_the_run_expected_step(own_bus):
    bus = own_bus
    for step in range(5):
        await publish_batch(bus, make_batch("run_a", step))
    intake = Intake(bus, _consumer(bus), unknown_run_hold=30.0)
    await _fill(intake, 5)

    # run_a's checkpoint holds 2 steps, it has trained 3: step 3 is next
    selection = await intake.select({"run_a": RunSteps(next_step=3, committed_step=2)})
    assert selection.train["run_a"].batch.step == 3
    assert [h.batch.step for h in selection.uncommitted] == [2]
    assert sorted(intake.pending["run_a"]) == [4]  # held for its turn
    assert intake.num_skipped == 2  # steps 0 and 1 were acked
    # unacked: the trained-but-uncommitted step 2, the step 3 handed out, the held step 4
    assert await _ack_pending(bus) == 3

    # a second message for a held step (a republish outside the deduplication window)
    await publish_batch(bus, make_batch("run_a", 4, seed=1), msg_id="run_a/step_4/again")
    got = await intake.consumer.fetch(batch=8, timeout=2.0)
    await intake.add(*got[0])
    kept = intake.pending["run_a"][4]
    assert kept.batch == make_batch("run_a", 4)  # the first one stays
    assert intake.num_skipped == 3
    assert not intake.has_trainable({"run_a": RunSteps(next_step=5, committed_step=5)})
    assert intake.has_trainable({"run_a": RunSteps(next_step=4, committed_step=4)})
    # a run given a batch this step is left alone by the second pick
    again = await intake.select({"run_a": RunSteps(4, 4)}, skip={"run_a"})
    assert again.train == {} and 4 in intake.pending["run_a"]


async def test_unknown_runs_are_held_then_handed_back_and_gone_runs_dropped(own_bus):
    bus = own_bus
    await publish_batch(bus, make_batch("run_new", 0))
    await publish_batch(bus, make_batch("run_gone", 0))
    intake = Intake(bus, _consumer(bus), unknown_run_hold=0.3)
    await _fill(intake, 2)
    intake.removed.add("run_gone")

    await intake.select({})
    assert intake.num_dropped == 1 and "run_gone" not in intake.pending
    assert "run_new" in intake.pending  # its RunDiscovered may still be on the way
    await asyncio.sleep(0.35)
    await intake.select({})
    assert "run_new" not in intake.pending
    # handed back with a delay: redelivered to whoever fetches next, once the delay is over
    redelivered = []
    for _ in range(20):
        redelivered += await intake.consumer.fetch(batch=8, timeout=0.25)
        if redelivered:
            break
    [(batch, delivery)] = redelivered
    assert (batch.run_id, delivery.num_delivered) == ("run_new", 2)


async def test_a_batch_on_another_runs_subject_is_rejected(own_bus):
    bus = own_bus
    await bus.publish("plexrl.rollouts.run_other", make_batch("run_a", 0), msg_id="x")
    intake = Intake(bus, _consumer(bus))
    [(event, delivery)] = await intake.consumer.fetch(batch=8, timeout=2.0)
    await intake.add(event, delivery)
    assert intake.pending == {}
    assert await _ack_pending(bus) == 0  # terminated, not left for redelivery
    assert bus.invalid_count == 1


async def test_a_batch_from_another_tenant_is_refused_and_the_run_left_alone(own_bus):
    bus = own_bus
    tenants = {"run_b": "beta"}
    # acme sends a batch for beta's run on its own subject (all the broker lets it use)
    await bus.publish("plexrl.rollouts.acme.run_b", make_batch("run_b", 3, seed=7), msg_id="f")
    await bus.publish("plexrl.rollouts.beta.run_b", make_batch("run_b", 3), msg_id="r")
    intake = Intake(bus, _consumer(bus), tenant_of=tenants.get)
    got = await intake.consumer.fetch(batch=8, timeout=2.0)
    assert len(got) == 2
    for batch, delivery in got:
        await intake.add(batch, delivery)
    assert intake.num_wrong_tenant == 1 and bus.invalid_count == 1
    [held] = intake.pending["run_b"].values()
    assert (held.tenant, held.batch) == ("beta", make_batch("run_b", 3))
    selection = await intake.select({"run_b": RunSteps(next_step=3, committed_step=3)})
    assert selection.train["run_b"].batch == make_batch("run_b", 3)
    assert await _ack_pending(bus) == 1  # the refused one terminated, beta's handed out
    report = await bus.js.get_last_msg("PLEXRL_ERRORS", "plexrl.errors.test")
    assert b"tenant 'acme' sent a RolloutBatch (step 3) for run_b" in (report.data or b"")
    assert b"belongs to tenant 'beta'" in (report.data or b"")


async def test_batches_from_two_tenants_for_an_unknown_run_are_sorted_out_once_it_is_known(
    own_bus,
):
    bus = own_bus
    tenants: dict[str, str] = {}
    await bus.publish("plexrl.rollouts.acme.run_b", make_batch("run_b", 0, seed=7), msg_id="f")
    await bus.publish("plexrl.rollouts.beta.run_b", make_batch("run_b", 0), msg_id="r")
    intake = Intake(bus, _consumer(bus), tenant_of=tenants.get, unknown_run_hold=30.0)
    await _fill(intake, 1)
    for _ in range(20):
        if intake.pending["run_b"][0].rivals:
            break
        for batch, delivery in await intake.consumer.fetch(batch=8, timeout=0.25):
            await intake.add(batch, delivery)
    assert [h.tenant for h in intake.pending["run_b"][0].all()] == ["acme", "beta"]
    tenants["run_b"] = "beta"  # its RunDiscovered applied
    selection = await intake.select({"run_b": RunSteps(next_step=0, committed_step=0)})
    assert selection.train["run_b"].batch == make_batch("run_b", 0)
    assert selection.train["run_b"].tenant == "beta" and intake.num_wrong_tenant == 1
    assert await _ack_pending(bus) == 1
