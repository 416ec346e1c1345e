"""Idempotent provisioning of the streams, KV buckets and object store of DESIGN.md.

Every service calls :func:`provision` at start-up; a second call changes nothing. An existing
stream whose settings differ is updated in place (subjects and limits), never recreated, so no
message is lost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nats.js import JetStreamContext, api
from nats.js.errors import BucketNotFoundError, NotFoundError

from schemas import subjects as sj

DAY = 24 * 3600.0


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    description: str
    max_age: float = 0.0  # seconds; 0 keeps messages until limits say otherwise
    max_msgs_per_subject: int = -1
    duplicate_window: float = 120.0

    def config(self, replicas: int) -> api.StreamConfig:
        return api.StreamConfig(
            name=self.name,
            description=self.description,
            subjects=list(self.subjects),
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            max_age=self.max_age or None,
            max_msgs_per_subject=self.max_msgs_per_subject,
            duplicate_window=self.duplicate_window,
            num_replicas=replicas,
            # a tenant reads the last message of its own subjects through the direct-get API,
            # whose subject names the message subject, so the broker can permit exactly those
            allow_direct=True,
        )


STREAMS: tuple[StreamSpec, ...] = (
    # Lifecycle events are kept for good: a run mirror replays them from the start.
    StreamSpec(
        sj.RUNS_STREAM, (sj.RUNS_WILDCARD,), "run lifecycle events", duplicate_window=3600.0
    ),
    # A restarted orchestrator may republish a step long after the first try: an hour of
    # deduplication by message id, and the trainer skips trained steps beyond that.
    StreamSpec(
        sj.ROLLOUTS_STREAM,
        (sj.ROLLOUTS_WILDCARD,),
        "rollout batches, one message per run step",
        max_age=7 * DAY,
        duplicate_window=3600.0,
    ),
    StreamSpec(
        sj.WEIGHTS_STREAM,
        (sj.WEIGHTS_WILDCARD,),
        "WeightsReady announcements, the latest few per run",
        max_msgs_per_subject=8,
    ),
    StreamSpec(
        "PLEXRL_ERRORS",
        ("plexrl.errors.>",),
        "invalid messages and service errors",
        max_age=7 * DAY,
    ),
)


def _differs(current: api.StreamConfig, wanted: api.StreamConfig) -> bool:
    for f in (
        "subjects",
        "description",
        "max_age",
        "max_msgs_per_subject",
        "duplicate_window",
        "num_replicas",
        "allow_direct",
    ):
        a, b = getattr(current, f), getattr(wanted, f)
        if f == "subjects":
            a, b = sorted(a or []), sorted(b or [])
        if f == "max_age":
            a, b = a or 0, b or 0
        if f == "num_replicas":
            # never lower a stream's replica count: an operator may have raised it on purpose
            if (a or 1) < (b or 1):
                return True
            continue
        if a != b:
            return True
    return False


async def provision(js: JetStreamContext, replicas: int = 1) -> list[str]:
    """Create or update every stream, bucket and the object store. Returns what changed."""
    changed: list[str] = []
    for spec in STREAMS:
        wanted = spec.config(replicas)
        try:
            info = await js.stream_info(spec.name)
        except NotFoundError:
            await js.add_stream(wanted)
            changed.append(f"created stream {spec.name}")
            continue
        if _differs(info.config, wanted):
            merged = dataclasses.replace(
                info.config,
                subjects=wanted.subjects,
                description=wanted.description,
                max_age=wanted.max_age,
                max_msgs_per_subject=wanted.max_msgs_per_subject,
                duplicate_window=wanted.duplicate_window,
                allow_direct=wanted.allow_direct,
                num_replicas=max(info.config.num_replicas or 1, replicas),
            )
            await js.update_stream(merged)
            changed.append(f"updated stream {spec.name}")
    for bucket, description in sj.KV_BUCKETS.items():
        try:
            await js.key_value(bucket)
        except BucketNotFoundError:
            await js.create_key_value(
                api.KeyValueConfig(
                    bucket=bucket, description=description, history=5, replicas=replicas
                )
            )
            changed.append(f"created bucket {bucket}")
    try:
        await js.object_store(sj.OBJECT_STORE_WEIGHTS)
    except (BucketNotFoundError, NotFoundError):
        # nats-py 2.x: passing a config that names the bucket fails; the name alone works.
        await js.create_object_store(sj.OBJECT_STORE_WEIGHTS, replicas=replicas)
        changed.append(f"created object store {sj.OBJECT_STORE_WEIGHTS}")
    return changed
