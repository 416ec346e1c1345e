"""The gateway's HTTP application: one FastAPI app with the OpenAI routes under ``/v1`` and the
Tinker routes under ``/api/v1``, served by uvicorn inside the service's own event loop.

The app shares the loop with the NATS connection, so a route awaits a bus request directly; no
thread hop, no second loop. Every request but the health checks is authenticated first
(:mod:`services.gateway.tenancy`): a route sees the gateway through a :class:`Scope`, the
backend and futures of its request's tenant, and nothing of any other tenant's. Request bodies
are read here, once, with the size limit applied while the bytes arrive (a client that lies
about ``Content-Length`` or streams a chunked body is cut off at ``max_body_bytes``), and decoded
as JSON with a clear error when they are not or nest deeper than ``MAX_JSON_DEPTH``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from services.gateway.backend import Backend, GatewayError
from services.gateway.connections import (
    ConnectionGuard,
    connection_cap,
    guarded_protocol,
    quiet_accept_errors,
)
from services.gateway.futures import Futures, Outcome
from services.gateway.observe import observe
from services.gateway.sessions import SESSION_LABEL, Sessions
from services.gateway.settings import GatewaySettings
from services.gateway.tenancy import Tenancy
from services.gateway.text import TextCodec

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

MAX_JSON_DEPTH = 64
"""how deeply a request body's JSON may nest (every body the APIs define nests a few levels)"""

OPEN_PATHS = frozenset({"/healthz", "/api/v1/healthz"})
"""what answers without an API key"""

OPEN_PREFIXES = ("/api/v1/downloads/",)
"""what answers without an API key because its URL is signed (services/gateway/downloads.py)"""

UNCOUNTED_PATHS = frozenset({"/api/v1/retrieve_future", "/api/v1/session_heartbeat"})
"""requests that wait on work already counted (a future) or do none"""


class Gateway:
    """What every route needs: who acts (tenancy), the settings, the tokenizer, the futures."""

    def __init__(self, tenancy: Tenancy, settings: GatewaySettings, codec: TextCodec) -> None:
        self.tenancy = tenancy
        self.settings = settings
        self.codec = codec
        self.futures = Futures(settings.future_ttl_s, tenancy)
        self.sessions = Sessions(settings.session_ttl_s, self._evict)
        self.url_key = secrets.token_bytes(32)
        """signs this process's download URLs (a restarted gateway's old URLs stop working)"""

    async def _evict(self, tenant: str, run_ids: list[str], reason: str) -> None:
        backend = await self.tenancy.backend(tenant)
        for run_id in run_ids:
            await backend.evict(run_id, reason)

    async def adopt_sessions(self, backend: Backend) -> None:
        """Once per tenant: find the sessions of its runs (their labels) after a restart."""
        if self.sessions.adopted(backend.tenant):
            return
        rows = await backend.runs()
        self.sessions.adopt(
            backend.tenant,
            {
                r.run_id: r.labels[SESSION_LABEL]
                for r in rows
                if r.status in ("active", "waiting")
                and r.tenant == backend.tenant
                and r.labels.get(SESSION_LABEL)
            },
        )

    async def keep_sessions(self, stop: asyncio.Event) -> None:
        """Until ``stop``: adopt the sessions of every connected tenant, expire silent ones."""
        every = min(5.0, self.settings.session_ttl_s / 4)
        while not stop.is_set():
            for backend in self.tenancy.connected():
                try:
                    await self.adopt_sessions(backend)
                except GatewayError as exc:
                    log.debug("gateway: sessions of %s not read yet: %s", backend.tenant, exc)
            await self.sessions.expire()
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass


@dataclass(frozen=True)
class TenantFutures:
    """The futures of one tenant (:class:`~services.gateway.futures.Futures`)."""

    futures: Futures
    tenant: str

    def start(
        self,
        key: str,
        work: Callable[[], Awaitable[Outcome]],
        order: str | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> str:
        return self.futures.start(self.tenant, key, work, order, on_done)

    async def wait(self, future_id: str, timeout: float) -> Outcome | None:
        return await self.futures.wait(self.tenant, future_id, timeout)

    def known(self, future_id: str) -> bool:
        return self.futures.known(self.tenant, future_id)

    def cancel(self, future_id: str) -> bool:
        return self.futures.cancel(self.tenant, future_id)


@dataclass(frozen=True)
class Scope:
    """The gateway as one request sees it: its tenant's backend and futures."""

    gateway: Gateway
    tenant: str
    backend: Backend

    @property
    def settings(self) -> GatewaySettings:
        return self.gateway.settings

    @property
    def codec(self) -> TextCodec:
        return self.gateway.codec

    @property
    def futures(self) -> TenantFutures:
        return TenantFutures(self.gateway.futures, self.tenant)

    @property
    def sessions(self) -> Sessions:
        return self.gateway.sessions


def gateway_of(request: Request) -> Scope:
    """The gateway as this request's tenant sees it (set by :func:`authenticate`)."""
    scope: Scope = request.state.scope
    return scope


def error_response(request: Request, exc: GatewayError) -> JSONResponse:
    """``exc`` in the error shape of the API the request was for."""
    from services.gateway.openai_api import openai_error
    from services.gateway.tinker_api import tinker_error

    if request.url.path.startswith("/api/"):
        response = tinker_error(exc.status, exc.message)
    else:
        response = openai_error(exc.status, exc.message, exc.code)
    if exc.retry_after is not None:  # whole seconds, as RFC 9110 has it, at least 1
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return response


async def authenticate(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """The HTTP middleware that finds the request's tenant (401 without a valid key), counts
    it against the key's limit (429 past it) and gives the routes its :class:`Scope`."""
    if request.url.path in OPEN_PATHS or request.url.path.startswith(OPEN_PREFIXES):
        return await call_next(request)
    gateway: Gateway = request.app.state.gateway
    counted = request.url.path not in UNCOUNTED_PATHS
    try:
        tenant = gateway.tenancy.tenant_of(dict(request.headers))
        backend = await gateway.tenancy.backend(tenant)
        if counted:
            gateway.tenancy.begin(tenant)
    except GatewayError as exc:
        return error_response(request, exc)
    request.state.scope = Scope(gateway, tenant, backend)
    try:
        return await call_next(request)
    finally:
        if counted:
            gateway.tenancy.end(tenant)


class ClientGone(GatewayError):
    """The client closed its connection before its request's body arrived: nobody to answer,
    and nothing wrong with the gateway (logged at debug level only)."""

    def __init__(self) -> None:
        super().__init__(499, "the client disconnected", "client_closed_request")


async def while_connected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or :class:`ClientGone` once the client disconnects first: then
    ``work`` is cancelled (a generation tells inference to drop it)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        gone.cancel()
        raise
    gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    log.debug("gateway: %s %s: the client left mid-request", request.method, request.url.path)
    raise ClientGone()


async def _disconnect(request: Request) -> None:
    """Returns once the client has closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (checked as it arrives) and with
    408 when it has not all arrived within ``body_timeout_s``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(
            413, f"request body of {declared} bytes is over the limit of {limit}", "too_large"
        )
    chunks: list[bytes] = []
    size = 0
    wait = request.app.state.gateway.settings.body_timeout_s
    try:
        async with asyncio.timeout(wait):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise GatewayError(
                        413, f"request body is over the limit of {limit} bytes", "too_large"
                    )
                chunks.append(chunk)
    except ClientDisconnect:
        log.debug("gateway: %s %s: the client left mid-body", request.method, request.url.path)
        raise ClientGone() from None
    except TimeoutError:
        raise GatewayError(
            408, f"the request body did not arrive within {wait:g}s", "request_timeout"
        ) from None
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
    except RecursionError:  # nested past the parser's own limit
        raise GatewayError(
            400,
            f"the request body's JSON nests deeper than {MAX_JSON_DEPTH} levels",
            "invalid_json",
        ) from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise GatewayError(
            400,
            f"the request body's JSON nests deeper than {MAX_JSON_DEPTH} levels",
            "invalid_json",
        )
    if not isinstance(value, dict):
        raise GatewayError(400, "the request body must be a JSON object", "invalid_json")
    return value


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests (a scalar: 0), found without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:
            stack.extend((child, depth + 1) for child in children)
    return deepest


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
    from services.gateway.tinker_checkpoints import router as checkpoints_router
    from services.gateway.tinker_sessions import router as sessions_router
    from services.gateway.tinker_states import router as states_router
    from services.gateway.tinker_training import router as training_router

    app = FastAPI(title="plexrl gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.middleware("http")(authenticate)
    app.middleware("http")(observe)  # added last: the outermost, so a refused request is seen
    app.include_router(openai_router)
    app.include_router(tinker_router)
    app.include_router(training_router)
    app.include_router(sessions_router)
    app.include_router(states_router)
    app.include_router(checkpoints_router)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return error_response(request, exc)

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
    guard = ConnectionGuard(connection_cap(settings.max_connections), settings.header_timeout_s)
    app.state.connections = guard
    quiet_accept_errors()
    config = uvicorn.Config(
        app,
        http=guarded_protocol(guard),
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=10,
        timeout_keep_alive=int(max(1, settings.keep_alive_s)),
        backlog=min(2048, guard.max_connections),
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
