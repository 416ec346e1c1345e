"""The Tinker API's sessions (``/api/v1``): create, heartbeat, finish, list and look up.

See :mod:`services.gateway.sessions` for what a session holds and when it ends. Every route acts
on the caller's tenant's sessions only: another tenant's session id is as unknown as one never
created (a 404 for a lookup; a heartbeat or finish of it concerns a session of the caller's
own, which holds none of the other tenant's runs).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from services.gateway.app import Scope, gateway_of, parse_body, read_json
from services.gateway.backend import GatewayError
from services.gateway.tinker_bodies import CreateSessionBody, FinishBody, Page, SessionBody

router = APIRouter(prefix="/api/v1")


async def _adopted(gateway: Scope) -> None:
    await gateway.gateway.adopt_sessions(gateway.backend)


@router.post("/create_session")
async def create_session(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    body = parse_body(CreateSessionBody, await read_json(request))
    metadata = {str(k): str(v) for k, v in (body.user_metadata or {}).items()}
    session = gateway.sessions.create(gateway.tenant, metadata, body.display_name or "")
    return {"type": "create_session", "session_id": session.session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request) -> Any:
    gateway = gateway_of(request)
    body = parse_body(SessionBody, await read_json(request))
    if body.session_id:
        await _adopted(gateway)
        known = gateway.sessions.get(gateway.tenant, body.session_id)
        if known is not None and known.finished is not None:
            raise GatewayError(410, f"session {body.session_id} has finished ({known.finished})")
        gateway.sessions.touch(gateway.tenant, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(request: Request, session_id: str) -> dict[str, Any]:
    gateway = gateway_of(request)
    body = parse_body(FinishBody, await read_json(request))
    await _adopted(gateway)
    reason = body.reason.type if body.reason is not None else "success"
    runs = await gateway.sessions.finish(gateway.tenant, session_id, reason)
    return {"type": "finish_session", "session_id": session_id, "evicted": runs}


@router.get("/sessions")
async def list_sessions(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    limit, offset = page(request)
    ids = [s.session_id for s in gateway.sessions.of(gateway.tenant)]
    return {"sessions": ids[offset : offset + limit]}


@router.get("/sessions/{session_id}")
async def get_session(request: Request, session_id: str) -> dict[str, Any]:
    gateway = gateway_of(request)
    await _adopted(gateway)
    session = gateway.sessions.get(gateway.tenant, session_id)
    if session is None:
        raise GatewayError(404, f"unknown session {session_id!r}")
    return {
        "training_run_ids": sorted(session.runs),
        "sampler_ids": list(session.samplers),
        "user_metadata": session.user_metadata or None,
        "display_name": session.display_name or None,
    }


def page(request: Request) -> tuple[int, int]:
    """``limit`` (1..1000, default 20) and ``offset`` of a listing's query string."""
    params = parse_body(Page, dict(request.query_params))
    return params.limit, params.offset
