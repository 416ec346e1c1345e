"""The gateway's HTTP application: one FastAPI app with the OpenAI routes under ``/v1`` and the
Tinker routes under ``/api/v1``, served by uvicorn inside the service's own event loop.

The app shares the loop with the NATS connection, so a route awaits a bus request directly; no
thread hop, no second loop. Request bodies are read here, once, with the size limit applied
while the bytes arrive (a client that lies about ``Content-Length`` or streams a chunked body
is cut off at ``max_body_bytes``), and decoded as JSON with a clear error when they are not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Iterator
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from services.gateway.backend import Backend, GatewayError
from services.gateway.futures import Futures
from services.gateway.observe import observe
from services.gateway.settings import GatewaySettings
from services.gateway.text import TextCodec

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class Gateway:
    """What every route needs: the backend (bus), the settings and the tokenizer."""

    def __init__(self, backend: Backend, settings: GatewaySettings, codec: TextCodec) -> None:
        self.backend = backend
        self.settings = settings
        self.codec = codec
        self.futures = Futures(settings.future_ttl_s)


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (checked as it arrives)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(
            413, f"request body of {declared} bytes is over the limit of {limit}", "too_large"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"request body is over the limit of {limit} bytes", "too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object; 400 when it is not one."""
    body = await read_body(request, gateway_of(request).settings.max_body_bytes)
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GatewayError(
            400, f"the request body is not valid JSON: {exc}", "invalid_json"
        ) from exc
    if not isinstance(value, dict):
        raise GatewayError(400, "the request body must be a JSON object", "invalid_json")
    return value


def parse_body(model: type[M], body: dict[str, Any]) -> M:
    """``body`` read as ``model``; a 400 naming the first field that does not fit."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise GatewayError(400, f"invalid request: {where}: {first['msg']}") from exc


def build_app(gateway: Gateway) -> FastAPI:
    """The FastAPI app of ``gateway``: OpenAI and Tinker routes, and their error shapes."""
    from services.gateway.openai_api import openai_error
    from services.gateway.openai_api import router as openai_router
    from services.gateway.tinker_api import router as tinker_router
    from services.gateway.tinker_api import tinker_error
    from services.gateway.tinker_training import router as training_router

    app = FastAPI(title="plexrl gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.middleware("http")(observe)
    app.include_router(openai_router)
    app.include_router(tinker_router)
    app.include_router(training_router)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        if request.url.path.startswith("/api/"):
            return tinker_error(exc.status, exc.message)
        return openai_error(exc.status, exc.message, exc.code)

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        message = f"{request.method} {request.url.path} is not an endpoint of this gateway"
        if request.url.path.startswith("/api/"):
            return tinker_error(404, message + " (this Tinker API feature is not supported)")
        return openai_error(404, message, "not_found")

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc: Exception) -> JSONResponse:
        message = f"{request.method} is not allowed on {request.url.path}"
        if request.url.path.startswith("/api/"):
            return tinker_error(405, message)
        return openai_error(405, message, "method_not_allowed")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # a bug, not bad input (that is a GatewayError): still answered in the route's shape
        log.error("gateway: %s %s failed: %r", request.method, request.url.path, exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
        if request.url.path.startswith("/api/"):
            return tinker_error(500, message)
        return openai_error(500, message, "internal_error")

    @app.get("/healthz")
    async def _health() -> dict[str, str]:
        return {"status": "ok"}

    return app


class CannotListen(RuntimeError):
    """The HTTP address cannot be bound (taken, or not an address of this machine)."""


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service's stop event ends it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_http(app: FastAPI, settings: GatewaySettings, stop: asyncio.Event) -> None:
    """Serve ``app`` on the configured address until ``stop`` is set, then finish the requests
    under way and return."""
    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        raise CannotListen(
            f"cannot listen on {settings.host}:{settings.port} ({exc.strerror or exc}); pick "
            "another --port or --host"
        ) from exc
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=10,
        access_log=False,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    log.info("gateway: serving http://%s:%d (OpenAI /v1, Tinker /api/v1)", host, port)
    print(f"plexrl gateway: listening on http://{host}:{port}", flush=True)
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        server.should_exit = True
        stopping.cancel()
        await task
        sock.close()
