"""Traces and metrics of the gateway's HTTP requests.

Each request continues the trace its W3C ``traceparent`` header names (or starts one) in a
SERVER span; the bus requests it makes (generate, training commands, run lists) are children of
that span, so one trace reaches inference and the trainer. The work of a Tinker future runs in
a task created inside the span and keeps it as its parent.

Metrics, per route and per run (the run a request named, ``-`` when none):
``plexrl_gateway_requests`` (with the HTTP status) and ``plexrl_gateway_request_seconds``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import Request, Response
from opentelemetry import metrics
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.bus import tracing

_meter = metrics.get_meter("plexrl.gateway")
REQUESTS = _meter.create_counter(
    "plexrl_gateway_requests", description="HTTP requests answered by the gateway"
)
REQUEST_SECONDS = _meter.create_histogram(
    "plexrl_gateway_request_seconds",
    unit="s",
    description="HTTP request received to response started, per route and run",
    explicit_bucket_boundaries_advisory=[0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
)


def note_run(request: Request, run_id: str) -> None:
    """Label this request's metrics and span with the run it concerns."""
    request.state.run_id = run_id


async def observe(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """The HTTP middleware: a span per request and its metrics."""
    tracer = tracing.tracer("plexrl.gateway")
    started = time.monotonic()
    with tracer.start_as_current_span(
        f"{request.method} {request.url.path}",
        context=tracing.extract(dict(request.headers)),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": request.method, "url.path": request.url.path},
    ) as span:
        response = await call_next(request)
        # the route's template (/api/v1/samplers/{session_id}), not the path: few label values
        route = getattr(request.scope.get("route"), "path", "unmatched")
        run_id = getattr(request.state, "run_id", "-")
        span.set_attribute("http.response.status_code", response.status_code)
        span.set_attribute("plexrl.run_id", run_id)
        if response.status_code >= 500:
            span.set_status(Status(StatusCode.ERROR))
    labels = {"route": route, "run_id": run_id}
    REQUESTS.add(1, labels | {"status": str(response.status_code)})
    REQUEST_SECONDS.record(time.monotonic() - started, labels)
    return response
