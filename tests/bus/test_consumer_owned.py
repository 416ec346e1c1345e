"""A service owns its durable consumers: one changed behind its back (another filter, a push
delivery subject, other ack limits) is put back at start, in place or anew, and the repair is
reported on plexrl.errors.<service>."""

from __future__ import annotations

import pytest
from nats.js import api

from schemas import subjects as sj
from schemas.codec import decode
from schemas.events import RunSubmitted, ServiceError
from services.bus import Bus, Consumer, EmbeddedNats


def _consumer(bus: Bus) -> Consumer[RunSubmitted]:
    return Consumer(
        bus,
        stream=sj.RUNS_STREAM,
        durable="registry-submit",
        filter_subject=sj.SUBMIT,
        event_type=RunSubmitted,
        ack_wait=10.0,
    )


@pytest.mark.parametrize(
    "tampered",
    [
        {"filter_subject": "plexrl.runs.acme.submit"},  # updated in place
        {"deliver_subject": "relay.elsewhere"},  # a push consumer: made anew
        {"max_ack_pending": 1, "ack_wait": 3600.0},
    ],
    ids=["filter", "push", "limits"],
)
async def test_a_consumer_changed_behind_the_services_back_is_restored_and_reported(
    server: EmbeddedNats, tampered: dict[str, object]
) -> None:
    bus = await Bus.connect(server.url, "registry")
    try:
        first = _consumer(bus)
        await first.start()
        await first.close()
        config = api.ConsumerConfig(
            durable_name="registry-submit",
            ack_policy=api.AckPolicy.EXPLICIT,
            filter_subject=sj.SUBMIT,
            ack_wait=10.0,
        )
        for field, value in tampered.items():
            setattr(config, field, value)
        if config.deliver_subject:  # a pull consumer is never updated into a push one: remade
            await bus.js.delete_consumer(sj.RUNS_STREAM, "registry-submit")
        await bus.js.add_consumer(sj.RUNS_STREAM, config)
        changed = await bus.js.consumer_info(sj.RUNS_STREAM, "registry-submit")
        assert any(getattr(changed.config, f) == v for f, v in tampered.items())

        consumer = _consumer(bus)
        await consumer.start()
        info = await bus.js.consumer_info(sj.RUNS_STREAM, "registry-submit")
        assert info.config.filter_subject == sj.SUBMIT
        assert info.config.deliver_subject is None
        assert (info.config.max_ack_pending, info.config.ack_wait) == (1000, 10.0)
        # it works as the service's consumer again: a submit is delivered to it
        await bus.publish(sj.SUBMIT, RunSubmitted(run_id="run_x", config={}))
        [(event, delivery)] = await consumer.fetch(timeout=5)
        assert event.run_id == "run_x"
        await delivery.ack()
        await consumer.close()
        report = await bus.js.get_last_msg(sj.ERRORS_STREAM, sj.errors_subject("registry"))
        error = decode(report.data or b"", ServiceError)
        assert "consumer registry-submit of stream PLEXRL_RUNS had been changed" in error.error
        assert error.context["consumer"] == "registry-submit"
    finally:
        await bus.close()
