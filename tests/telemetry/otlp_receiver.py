"""A tiny OTLP/HTTP trace receiver for tests, and a printer for the trees of spans it collects."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start_ns: int
    attributes: dict[str, Any] = field(hash=False)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver:
    """Accepts ``POST /v1/traces`` on 127.0.0.1 and keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/traces":
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver._add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        Span(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            name=s.name,
                            service=str(resource.get("service.name", "?")),
                            start_ns=s.start_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self._lock:
            self.spans.extend(spans)

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)


def render_tree(spans: list[Span], root: Span, keys: tuple[str, ...] = ()) -> str:
    """The tree under ``root``, one span a line: indented name, [service], chosen attributes."""
    children: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        children[s.parent_id].append(s)
    lines: list[str] = []

    def walk(span: Span, depth: int) -> None:
        attrs = " ".join(f"{k}={span.attributes[k]}" for k in keys if k in span.attributes)
        lines.append(f"{'  ' * depth}{span.name}  [{span.service}]{'  ' + attrs if attrs else ''}")
        for child in sorted(children[span.span_id], key=lambda c: c.start_ns):
            walk(child, depth + 1)

    walk(root, 0)
    return "\n".join(lines)
