"""OpenTelemetry metrics with a Prometheus scrape endpoint, and the instruments plexrl records.

``setup_metrics(service)`` installs the process-wide meter provider once. When
``PLEXRL_METRICS_PORT`` (or the standard ``OTEL_EXPORTER_PROMETHEUS_PORT``) names a port, it
also serves ``http://<host>:<port>/metrics`` in a background thread; the host is
``PLEXRL_METRICS_HOST`` (or ``OTEL_EXPORTER_PROMETHEUS_HOST``), ``127.0.0.1`` by default. Unset
or ``0`` serves nothing and every ``record_*`` below costs next to nothing. A port that cannot
be bound is logged and the service runs on without the endpoint: losing metrics never stops
training.

The instruments are created on the global meter at import time, so callers record through the
``record_*`` functions without caring whether metrics are on. Names are what Prometheus shows;
the labels are the attributes passed here (see services/telemetry/README.md for the list).
Per-run instruments carry the run's ``tenant`` beside its ``run_id`` (``default`` when no
tenants are configured), so a dashboard can sum a tenant's runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import metrics
from opentelemetry.metrics import Meter

from schemas.tenant import DEFAULT_TENANT
from services.config.process import process_settings

log = logging.getLogger(__name__)


_served: tuple[str, int] | None = None
_configured = False


def metrics_address(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """``(host, port)`` to serve ``/metrics`` on, or None when metrics export is off.

    ``PLEXRL_METRICS_PORT``/``_HOST`` come through the process settings; the standard
    OpenTelemetry variables are the fallback.
    """
    env = os.environ if environ is None else environ
    settings = process_settings(env)
    port = settings.metrics_port
    if port is None:
        raw = env.get("OTEL_EXPORTER_PROMETHEUS_PORT", "").strip() or "0"
        if not raw.isdigit() or int(raw) > 65535:
            raise ValueError(
                f"OTEL_EXPORTER_PROMETHEUS_PORT must be a port number (0: off), got {raw!r}"
            )
        port = int(raw)
    host = (
        settings.metrics_host or env.get("OTEL_EXPORTER_PROMETHEUS_HOST", "").strip() or "127.0.0.1"
    )
    return (host, port) if port else None


def setup_metrics(service_name: str, environ: Mapping[str, str] | None = None) -> Meter:
    """Install the meter provider (once per process) and serve ``/metrics`` if a port is set."""
    global _configured, _served
    address = metrics_address(environ)
    # Only a call that names a port configures: the first such call in a process wins.
    if not _configured and address is not None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import Resource
        from prometheus_client import start_http_server

        env = os.environ if environ is None else environ
        name = env.get("OTEL_SERVICE_NAME") or f"plexrl-{service_name}"
        try:
            start_http_server(address[1], addr=address[0])
        except OSError as exc:
            log.error(
                "%s: cannot serve metrics on %s:%d (%s); running without them. Pick a free "
                "port with %s.",
                service_name,
                *address,
                exc,
                "PLEXRL_METRICS_PORT",
            )
        else:
            provider = MeterProvider(
                resource=Resource.create({"service.name": name}),
                metric_readers=[PrometheusMetricReader()],
            )
            metrics.set_meter_provider(provider)
            _served = address
            log.info("%s: metrics on http://%s:%d/metrics", service_name, *address)
        _configured = True
    return metrics.get_meter(f"plexrl.{service_name}")


def served_address() -> tuple[str, int] | None:
    """Where this process serves ``/metrics``, once :func:`setup_metrics` started it."""
    return _served


# --- instruments -------------------------------------------------------------------------------
# Created on the global (proxy) meter: they start recording once setup_metrics installs a provider.

_meter = metrics.get_meter("plexrl")

REWARD = _meter.create_gauge(
    "plexrl_reward", description="mean reward of the run's latest published step"
)
STEP = _meter.create_gauge("plexrl_step", description="the run's latest published step")
POLICY_LAG = _meter.create_gauge(
    "plexrl_policy_lag",
    description="steps between the batch's step and its oldest sample's policy version",
)
TOKENS_PER_SECOND = _meter.create_gauge(
    "plexrl_tokens_per_second",
    description="completion tokens per second of generation in the run's latest step",
)
QUEUE_DEPTH = _meter.create_gauge(
    "plexrl_queue_depth",
    description="messages pending for a durable consumer, as of its latest fetch",
)
WEIGHT_SYNC_LATENCY = _meter.create_histogram(
    "plexrl_weight_sync_latency_seconds",
    unit="s",
    description="WeightsReady stored on the stream to the adapter installed in inference",
    explicit_bucket_boundaries_advisory=[0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
)
REQUESTS_SERVED = _meter.create_counter(
    "plexrl_requests_served", description="GenerateRequests answered by an inference replica"
)
INVALID_MESSAGES = _meter.create_counter(
    "plexrl_invalid_messages",
    description="messages terminated because they failed to decode or validate",
)
TRAINER_STEP_SECONDS = _meter.create_histogram(
    "plexrl_trainer_step_seconds",
    unit="s",
    description="wall time of one run's optimizer step in the trainer, pack to optimizer",
    explicit_bucket_boundaries_advisory=[0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
)
TRAINER_TOKENS = _meter.create_counter(
    "plexrl_trainer_tokens", description="tokens trained on, per run"
)
TRAINER_SAMPLES = _meter.create_counter(
    "plexrl_trainer_samples", description="samples trained on, per run"
)
TRAINER_QUEUE_WAIT = _meter.create_histogram(
    "plexrl_trainer_queue_wait_seconds",
    unit="s",
    description="a RolloutBatch stored on the stream to the start of the step that trained it",
    explicit_bucket_boundaries_advisory=[0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300],
)
GENERATE_WAIT = _meter.create_histogram(
    "plexrl_generate_wait_seconds",
    unit="s",
    description="a GenerateRequest received by inference to its answer, waiting for the "
    "policy version it asks for included",
    explicit_bucket_boundaries_advisory=[0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
)
GENERATED_TOKENS = _meter.create_counter(
    "plexrl_generated_tokens", description="completion tokens generated by inference, per run"
)
GENERATE_DROPPED = _meter.create_counter(
    "plexrl_generate_dropped",
    description="GenerateRequests an inference replica dropped before their end, by reason: "
    "deadline (passed), cancelled (by the requester), overloaded (refused at arrival)",
)


PAUSED_OPERATIONS = _meter.create_up_down_counter(
    "plexrl_paused_operations",
    description="operations of this process waiting now: for room in a full store "
    "(reason=store_full, store=the stream, bucket or object store) or for JetStream to answer "
    "again (reason=jetstream_unavailable, store=jetstream)",
)
PAUSES = _meter.create_counter(
    "plexrl_pauses",
    description="operations that had to wait for room in a full store or for JetStream, since "
    "the process started (labels as plexrl_paused_operations)",
)


def _run(run_id: str, tenant: str) -> dict[str, str]:
    return {"run_id": run_id, "tenant": tenant}


def record_step(
    run_id: str,
    *,
    step: int,
    reward_mean: float,
    policy_lag: int,
    tokens_per_s: float,
    tenant: str = DEFAULT_TENANT,
) -> None:
    """An orchestrator published ``step`` of ``run_id``."""
    labels = _run(run_id, tenant)
    STEP.set(step, labels)
    REWARD.set(reward_mean, labels)
    POLICY_LAG.set(policy_lag, labels)
    TOKENS_PER_SECOND.set(tokens_per_s, labels)


def record_queue_depth(service: str, consumer: str, pending: int) -> None:
    QUEUE_DEPTH.set(pending, {"service": service, "consumer": consumer})


def record_weight_sync(run_id: str, seconds: float, *, tenant: str = DEFAULT_TENANT) -> None:
    WEIGHT_SYNC_LATENCY.record(max(seconds, 0.0), _run(run_id, tenant))


def record_request_served(
    run_id: str,
    *,
    ok: bool,
    tenant: str = DEFAULT_TENANT,
    seconds: float | None = None,
    tokens: int = 0,
) -> None:
    """An inference replica answered a request of ``run_id`` after ``seconds``, generating
    ``tokens`` completion tokens."""
    REQUESTS_SERVED.add(1, _run(run_id, tenant) | {"outcome": "ok" if ok else "error"})
    if seconds is not None:
        GENERATE_WAIT.record(max(seconds, 0.0), _run(run_id, tenant))
    if tokens:
        GENERATED_TOKENS.add(tokens, _run(run_id, tenant))


def record_generate_dropped(reason: str, *, run_id: str, tenant: str) -> None:
    """An inference replica dropped (or refused) a request of ``run_id`` for ``reason``."""
    GENERATE_DROPPED.add(1, _run(run_id, tenant) | {"reason": reason})


def record_pause(reason: str, store: str, delta: int) -> None:
    """An operation began (``delta`` 1) or ended (-1) a wait of ``reason`` on ``store``."""
    labels = {"reason": reason, "store": store}
    PAUSED_OPERATIONS.add(delta, labels)
    if delta > 0:
        PAUSES.add(1, labels)


def record_invalid(service: str, subject: str) -> None:
    INVALID_MESSAGES.add(1, {"service": service, "subject": subject})


def record_trainer_step(
    run_id: str,
    *,
    seconds: float,
    tokens: int,
    samples: int = 0,
    queue_wait: float | None = None,
    tenant: str = DEFAULT_TENANT,
) -> None:
    """The trainer stepped ``run_id`` on ``samples`` samples of ``tokens`` tokens, ``queue_wait``
    seconds after their batch was stored on the stream."""
    labels = _run(run_id, tenant)
    TRAINER_STEP_SECONDS.record(max(seconds, 0.0), labels)
    TRAINER_TOKENS.add(tokens, labels)
    TRAINER_SAMPLES.add(samples, labels)
    if queue_wait is not None:
        TRAINER_QUEUE_WAIT.record(max(queue_wait, 0.0), labels)
