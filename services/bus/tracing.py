"""OpenTelemetry set-up from the standard ``OTEL_*`` variables, and trace context in headers.

A tracer provider is always installed so every publish carries a W3C ``traceparent``; spans are
exported only when asked: ``OTEL_TRACES_EXPORTER=otlp`` (or an ``OTEL_EXPORTER_OTLP_*ENDPOINT``
set) exports over OTLP/HTTP, ``console`` prints them, ``none`` or nothing keeps them in-process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)

_configured_for: str | None = None


def setup_tracing(
    service_name: str, extra_processor: SpanProcessor | None = None
) -> TracerProvider:
    """Install the process-wide tracer provider once; later calls return the same provider."""
    global _configured_for
    current = trace.get_tracer_provider()
    if _configured_for is not None and isinstance(current, TracerProvider):
        if extra_processor is not None:
            current.add_span_processor(extra_processor)
        return current
    name = os.environ.get("OTEL_SERVICE_NAME") or f"plexrl-{service_name}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if exporter == "otlp" or (endpoint and exporter not in ("none", "console")):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    if extra_processor is not None:
        provider.add_span_processor(extra_processor)
    trace.set_tracer_provider(provider)
    _configured_for = service_name
    return provider


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush(timeout_millis=5000)


def tracer(name: str = "plexrl") -> trace.Tracer:
    return trace.get_tracer(name)


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Write the current trace context (``traceparent``, ``tracestate``) into ``headers``."""
    propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context a publisher put in ``headers`` (empty context if none)."""
    return propagate.extract(dict(headers or {}))
