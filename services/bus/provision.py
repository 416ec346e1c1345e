"""Idempotent provisioning of the streams, KV buckets and object stores of DESIGN.md, with the
storage limits of the process settings.

Every service calls :func:`provision` at start-up; a second call changes nothing. An existing
stream whose settings differ is updated in place (subjects and limits), never recreated, so no
message is lost. Limits come from :class:`~services.config.ProcessSettings`
(``PLEXRL_*_MAX_BYTES``, ``PLEXRL_*_MAX_AGE_S``); docs/transports.md, "Storage limits", says
what each one bounds and why. Two rules keep an existing deployment working:

- a byte limit is never set below what a stream already holds (that would refuse every write
  until it shrank): it is applied once the stream holds less, and a warning says so;
- a limit the server cannot reserve (the ``max_bytes`` of all streams must fit in its
  JetStream store) is a :class:`~services.bus.errors.StorageFull` that names the setting to
  lower, raised before anything else changes.

Data that must not be lost is refused when its stream is full (``discard: new``): the publisher
waits (:func:`services.bus.limits.wait_while_full`). Only error reports, which are diagnostics,
give way to newer ones (``discard: old``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import NoReturn

from nats.js import JetStreamContext, api
from nats.js.client import KV_STREAM_TEMPLATE
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.object_store import OBJ_STREAM_TEMPLATE

from schemas import subjects as sj
from services.bus.limits import STREAM_SETTINGS, reservation_error
from services.config import ProcessSettings, env_name, process_settings

log = logging.getLogger(__name__)

KV_HISTORY = 5
"""Revisions kept per key of each KV bucket."""

WEIGHTS_PER_RUN = 8
"""WeightsReady announcements kept per run subject (a replica reads the newest)."""


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    description: str
    max_bytes: int = -1
    max_age: float = 0.0  # seconds; 0 keeps messages until limits say otherwise
    max_msgs_per_subject: int = -1
    duplicate_window: float = 120.0
    discard: api.DiscardPolicy = api.DiscardPolicy.NEW

    def config(self, replicas: int) -> api.StreamConfig:
        return api.StreamConfig(
            name=self.name,
            description=self.description,
            subjects=list(self.subjects),
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            max_bytes=self.max_bytes,
            max_age=self.max_age or None,
            max_msgs_per_subject=self.max_msgs_per_subject,
            discard=self.discard,
            duplicate_window=self.duplicate_window,
            num_replicas=replicas,
            # a tenant reads the last message of its own subjects through the direct-get API,
            # whose subject names the message subject, so the broker can permit exactly those
            allow_direct=True,
        )


def _bytes(value: int) -> int:
    """JetStream's spelling of a byte limit: -1 for none (a setting of 0)."""
    return int(value) or -1


def stream_specs(settings: ProcessSettings) -> tuple[StreamSpec, ...]:
    """The four streams of DESIGN.md with the limits of ``settings``."""
    return (
        # Lifecycle events are kept for good: a run mirror replays them from the start.
        StreamSpec(
            sj.RUNS_STREAM,
            (sj.RUNS_WILDCARD,),
            "run lifecycle events",
            max_bytes=_bytes(settings.runs_max_bytes),
            duplicate_window=3600.0,
        ),
        # A restarted orchestrator may republish a step long after the first try: an hour of
        # deduplication by message id, and the trainer skips trained steps beyond that. The
        # trainer purges the batches it committed, so the byte limit bounds the backlog.
        StreamSpec(
            sj.ROLLOUTS_STREAM,
            (sj.ROLLOUTS_WILDCARD,),
            "rollout batches, one message per run step",
            max_bytes=_bytes(settings.rollouts_max_bytes),
            max_age=settings.rollouts_max_age_s,
            duplicate_window=3600.0,
        ),
        StreamSpec(
            sj.WEIGHTS_STREAM,
            (sj.WEIGHTS_WILDCARD,),
            "WeightsReady announcements, the latest few per run",
            max_bytes=_bytes(settings.weights_events_max_bytes),
            max_msgs_per_subject=WEIGHTS_PER_RUN,
        ),
        StreamSpec(
            sj.ERRORS_STREAM,
            (sj.ERRORS_WILDCARD,),
            "invalid messages and service errors",
            max_bytes=_bytes(settings.errors_max_bytes),
            max_age=settings.errors_max_age_s,
            discard=api.DiscardPolicy.OLD,
        ),
    )


_COMPARED = (
    "subjects",
    "description",
    "max_bytes",
    "max_age",
    "max_msgs_per_subject",
    "discard",
    "duplicate_window",
    "num_replicas",
    "allow_direct",
)


def _differs(current: api.StreamConfig, wanted: api.StreamConfig) -> bool:
    for f in _COMPARED:
        a, b = getattr(current, f), getattr(wanted, f)
        if f == "subjects":
            a, b = sorted(a or []), sorted(b or [])
        if f == "max_age":
            a, b = a or 0, b or 0
        if f == "max_bytes":
            a, b = a or -1, b or -1
        if f == "discard":
            a, b = a or api.DiscardPolicy.OLD, b or api.DiscardPolicy.OLD
        if f == "num_replicas":
            # never lower a stream's replica count: an operator may have raised it on purpose
            if (a or 1) < (b or 1):
                return True
            continue
        if a != b:
            return True
    return False


def _fitting_max_bytes(info: api.StreamInfo, wanted: int, setting: str) -> int:
    """``wanted``, unless the stream already holds more: then its current limit, with a
    warning (a limit below the contents would refuse every write until they shrank)."""
    held = info.state.bytes
    if wanted > 0 and held > wanted:
        log.warning(
            "%s holds %d bytes, more than %s=%d: its byte limit stays %s until it holds less "
            "(raise the setting, or let old data age out or be purged)",
            info.config.name,
            held,
            env_name(setting),
            wanted,
            info.config.max_bytes if (info.config.max_bytes or -1) > 0 else "none",
        )
        return info.config.max_bytes or -1
    return wanted


def _refused(exc: APIError, where: str, setting: str, max_bytes: int | None) -> NoReturn:
    """Raise the clear error for a limit the server cannot reserve, else ``exc`` itself."""
    clear = reservation_error(exc, where, setting, max_bytes or -1)
    if clear is None:
        raise exc
    raise clear from exc


async def _update(js: JetStreamContext, config: api.StreamConfig, where: str, setting: str) -> None:
    try:
        await js.update_stream(config)
    except APIError as exc:
        _refused(exc, where, setting, config.max_bytes)


async def _add(js: JetStreamContext, config: api.StreamConfig, where: str, setting: str) -> None:
    try:
        await js.add_stream(config)
    except APIError as exc:
        _refused(exc, where, setting, config.max_bytes)


async def _ensure_max_bytes(
    js: JetStreamContext, stream: str, max_bytes: int, where: str, setting: str
) -> bool:
    """Give the existing stream ``stream`` (a bucket's or a store's) the byte limit
    ``max_bytes``; True when it changed."""
    info = await js.stream_info(stream)
    wanted = _fitting_max_bytes(info, max_bytes, setting)
    if (info.config.max_bytes or -1) == wanted:
        return False
    await _update(js, dataclasses.replace(info.config, max_bytes=wanted), where, setting)
    return True


async def ensure_stream(
    js: JetStreamContext, spec: StreamSpec, replicas: int = 1, setting: str = ""
) -> str | None:
    """Create ``spec``'s stream, or update it in place where its settings differ (never below
    what it holds, see the module docstring); what changed, or None. ``setting`` names the
    setting of its byte limit in errors and warnings."""
    wanted = spec.config(replicas)
    try:
        info = await js.stream_info(spec.name)
    except NotFoundError:
        await _add(js, wanted, f"stream {spec.name}", setting)
        return f"created stream {spec.name}"
    wanted.max_bytes = _fitting_max_bytes(info, spec.max_bytes, setting)
    if not _differs(info.config, wanted):
        return None
    merged = dataclasses.replace(
        info.config,
        subjects=wanted.subjects,
        description=wanted.description,
        max_bytes=wanted.max_bytes,
        max_age=wanted.max_age,
        max_msgs_per_subject=wanted.max_msgs_per_subject,
        discard=wanted.discard,
        duplicate_window=wanted.duplicate_window,
        allow_direct=wanted.allow_direct,
        num_replicas=max(info.config.num_replicas or 1, replicas),
    )
    await _update(js, merged, f"stream {spec.name}", setting)
    return f"updated stream {spec.name}"


async def provision(
    js: JetStreamContext, replicas: int = 1, settings: ProcessSettings | None = None
) -> list[str]:
    """Create or update every stream, bucket and the object stores (a tenant's too), with the
    limits of ``settings`` (default: the process settings). Returns what changed."""
    settings = settings or process_settings()
    changed: list[str] = []
    for spec in stream_specs(settings):
        done = await ensure_stream(js, spec, replicas, STREAM_SETTINGS[spec.name])
        if done is not None:
            changed.append(done)
    kv_bytes = _bytes(settings.kv_max_bytes)
    for bucket, description in sj.KV_BUCKETS.items():
        where = f"KV bucket {bucket}"
        try:
            await js.key_value(bucket)
        except BucketNotFoundError:
            config = api.KeyValueConfig(
                bucket=bucket,
                description=description,
                history=KV_HISTORY,
                replicas=replicas,
                max_bytes=kv_bytes,
            )
            try:
                await js.create_key_value(config)
            except APIError as exc:
                _refused(exc, where, "kv_max_bytes", kv_bytes)
            changed.append(f"created bucket {bucket}")
            continue
        stream = KV_STREAM_TEMPLATE.format(bucket=bucket)
        if await _ensure_max_bytes(js, stream, kv_bytes, where, "kv_max_bytes"):
            changed.append(f"updated bucket {bucket}")
    store_bytes = _bytes(settings.weights_store_max_bytes)
    where = f"object store {sj.OBJECT_STORE_WEIGHTS}"
    try:
        await js.object_store(sj.OBJECT_STORE_WEIGHTS)
    except (BucketNotFoundError, NotFoundError):
        # nats-py 2.x: passing a config that names the bucket fails; the name alone works.
        try:
            await js.create_object_store(
                sj.OBJECT_STORE_WEIGHTS, replicas=replicas, max_bytes=store_bytes
            )
        except APIError as exc:
            _refused(exc, where, "weights_store_max_bytes", store_bytes)
        changed.append(f"created object store {sj.OBJECT_STORE_WEIGHTS}")
    else:
        stream = OBJ_STREAM_TEMPLATE.format(bucket=sj.OBJECT_STORE_WEIGHTS)
        if await _ensure_max_bytes(js, stream, store_bytes, where, "weights_store_max_bytes"):
            changed.append(f"updated object store {sj.OBJECT_STORE_WEIGHTS}")
    changed += await _tenant_stores(js, _bytes(settings.tenant_weights_store_max_bytes))
    return changed


async def _tenant_stores(js: JetStreamContext, max_bytes: int) -> list[str]:
    """The byte limit on every tenant's weights store that exists (new ones get it when they
    are created, :func:`services.weights.blobs.write_blob`)."""
    prefix = OBJ_STREAM_TEMPLATE.format(bucket=sj.OBJECT_STORE_WEIGHTS + "-")
    changed = []
    for name in await _stream_names(js):
        if not name.startswith(prefix):
            continue
        bucket = name.removeprefix("OBJ_")
        where = f"object store {bucket}"
        if await _ensure_max_bytes(js, name, max_bytes, where, "tenant_weights_store_max_bytes"):
            changed.append(f"updated object store {bucket}")
    return changed


async def _stream_names(js: JetStreamContext) -> list[str]:
    """Every stream's name, page by page (the server answers 256 at a time)."""
    names: list[str] = []
    while True:
        page = await js.streams_info(offset=len(names))
        names += [info.config.name or "" for info in page]
        if not page:
            return names
