"""Listing the keys of a weights store (:mod:`services.weights.blobs`) as its stream's leader has
them, on a single server or a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import json

import nats.errors
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError
from nats.js.object_store import OBJ_ALL_META_PRE_TEMPLATE

from services.bus import Bus
from services.weights.blobs import BUCKET, _bucket, _stream


async def list_keys(bus: Bus, timeout: float = 30.0, *, bucket: str = BUCKET) -> list[str]:
    """Every key in the store (deleted ones excluded) as its leader has it: a listing read on a
    replica still catching up after a restart (its consumer may sit on any) is read again until
    it reaches the leader's newest description (a message get, which only the leader answers)."""
    await _bucket(bus, bucket)  # made on first use
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            last = await bus.js.get_last_msg(
                _stream(bucket), OBJ_ALL_META_PRE_TEMPLATE.format(bucket=bucket)
            )
        except NotFoundError:  # no object was ever stored
            return []
        keys, seen = await asyncio.wait_for(_read_descriptions(bus, bucket), timeout)
        if seen >= (last.seq or 0):
            return keys
        if asyncio.get_running_loop().time() >= deadline:
            raise nats.errors.TimeoutError
        await asyncio.sleep(0.1)


async def _read_descriptions(bus: Bus, bucket: str) -> tuple[list[str], int]:
    """The live keys on the consumer's replica, and the newest description's stream sequence."""
    keys: list[str] = []
    seen = 0
    done = asyncio.get_running_loop().create_future()

    async def take(msg: Msg) -> None:
        nonlocal seen
        seen = max(seen, msg.metadata.sequence.stream)
        if not (info := api.ObjectInfo.from_response(json.loads(msg.data))).deleted:
            keys.append(info.name)
        if msg.metadata.num_pending == 0 and not done.done():
            done.set_result(None)

    policy = api.DeliverPolicy.LAST_PER_SUBJECT
    subject, stream = OBJ_ALL_META_PRE_TEMPLATE.format(bucket=bucket), _stream(bucket)
    sub = await bus.js.subscribe(
        subject, stream=stream, cb=take, ordered_consumer=True, deliver_policy=policy
    )
    try:
        await done
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return keys, seen
