"""Settings of the process rather than of one service, read by every ``plexrl`` command.

Each is the variable ``PLEXRL_<FIELD>`` (``--nats-url`` is also a flag); they go through
:func:`~services.config.loader.load_settings` like the services' own settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

from schemas.tenant import validate_tenant
from services.config.loader import load_settings

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"

MiB, GiB, DAY_S = 1 << 20, 1 << 30, 24 * 3600.0
_BYTES = "bytes (a number, or with a unit: 512MiB, 2GiB; 0: no limit of its own)"


class ProcessSettings(BaseModel):
    """Where NATS is and how this process treats it, the host and itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nats_url: str = Field(
        DEFAULT_NATS_URL, min_length=1, description="NATS server(s), comma-separated"
    )
    connect_wait_s: float = Field(
        180.0,
        ge=0,
        le=86400,
        description="seconds a service keeps retrying its first connection to NATS (0.25 s "
        "apart, doubling up to 5 s) before it exits; client commands (submit, runs, evict) do "
        "not wait",
    )
    stream_replicas: int = Field(
        1,
        ge=1,
        le=5,
        description="copies of each stream, bucket and object store: 1 on one server, 3 on a "
        "three-server cluster (provisioning raises the count of an existing stream)",
    )
    # Storage limits. Every service applies them at start-up (provisioning updates the streams,
    # buckets and stores), so give every service the same values (docs/transports.md, "Storage
    # limits").
    runs_max_bytes: ByteSize = Field(
        ByteSize(256 * MiB),
        ge=0,
        description=f"PLEXRL_RUNS (run lifecycle events, kept for good): {_BYTES}; when full, "
        "new lifecycle events wait",
    )
    rollouts_max_bytes: ByteSize = Field(
        ByteSize(2 * GiB),
        ge=0,
        description=f"PLEXRL_ROLLOUTS (batches not yet trained, and the newest of each run): "
        f"{_BYTES}; when full, orchestrators wait",
    )
    rollouts_keep_history: bool = Field(
        False,
        description="keep trained rollout batches in PLEXRL_ROLLOUTS (an audit trail, or to "
        "compare inference and trainer afterwards) instead of purging them after each "
        "checkpoint; its byte and age limits then bound the history",
    )
    rollouts_max_age_s: float = Field(
        7 * DAY_S,
        ge=0,
        description="seconds a rollout batch is kept at most, trained or not (0: no limit)",
    )
    weights_events_max_bytes: ByteSize = Field(
        ByteSize(64 * MiB),
        ge=0,
        description=f"PLEXRL_WEIGHTS (the newest 8 WeightsReady of each run): {_BYTES}; when "
        "full, the trainer waits",
    )
    errors_max_bytes: ByteSize = Field(
        ByteSize(256 * MiB),
        ge=0,
        description=f"PLEXRL_ERRORS (error reports): {_BYTES}; when full, the oldest reports go",
    )
    errors_max_age_s: float = Field(
        7 * DAY_S, ge=0, description="seconds an error report is kept at most (0: no limit)"
    )
    kv_max_bytes: ByteSize = Field(
        ByteSize(64 * MiB),
        ge=0,
        description=f"each KV bucket (plexrl-registry, plexrl-progress; 5 revisions per key): "
        f"{_BYTES}; when full, writers wait",
    )
    weights_store_max_bytes: ByteSize = Field(
        ByteSize(2 * GiB),
        ge=0,
        description=f"object store plexrl-weights (the newest PLEXRL_KEEP_WEIGHTS versions of "
        f"each run): {_BYTES}; when full, the trainer waits",
    )
    tenant_weights_store_max_bytes: ByteSize = Field(
        ByteSize(512 * MiB),
        ge=0,
        description=f"each tenant's object store plexrl-weights-<tenant>: {_BYTES}",
    )
    nats_server: Path | None = Field(
        None,
        description="the nats-server binary that `plexrl up` and the tests start (default: the "
        "one beside the Python interpreter, then PATH)",
    )
    cache_dir: Path | None = Field(
        None,
        description="base of plexrl's cache: `plexrl up` keeps its warm-started tiny model in "
        "{cache_dir}/plexrl/models (default: $XDG_CACHE_HOME, then ~/.cache)",
    )
    malloc_tuning: bool = Field(
        True,
        description="raise glibc's mmap and trim thresholds at start-up (services/model/host.py)",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="serve Prometheus /metrics on this port; 0 turns metrics off (unset: "
        "OTEL_EXPORTER_PROMETHEUS_PORT, then off)",
    )
    metrics_host: str | None = Field(
        None,
        min_length=1,
        description="address /metrics listens on (unset: OTEL_EXPORTER_PROMETHEUS_HOST, then "
        "127.0.0.1)",
    )
    tenant: str = Field(
        "default",
        description="the tenant this client acts for: its runs' subjects carry the name and its "
        "credentials allow no other (services keep 'default', which may act for every tenant)",
    )
    nats_creds: Path | None = Field(
        None,
        description="credentials for NATS: an nkey seed file (`plexrl tenants add` writes one "
        "per tenant) or a .creds file (user JWT and seed); unset: no authentication",
    )
    tls_ca: Path | None = Field(
        None, description="CA certificate (PEM) that signed the NATS server's certificate"
    )
    tls_cert: Path | None = Field(
        None, description="client certificate (PEM), where the server asks for one"
    )
    tls_key: Path | None = Field(None, description="private key (PEM) of tls_cert")
    fault: str = Field(
        "",
        description="tests only: exit with status 137 at a named point, "
        "'<point>[@<run_id>][:<at>]' (services/launch/faults.py)",
    )

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, v: str) -> str:
        return validate_tenant(v)


def process_settings(environ: Mapping[str, str] | None = None, **flags: Any) -> ProcessSettings:
    """The process settings from ``PLEXRL_*`` (``environ``, default ``os.environ``) and flags."""
    return load_settings(ProcessSettings, None, flags, environ)
