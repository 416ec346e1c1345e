"""The Tinker API's training runs and checkpoints (``/api/v1``): what ``RestClient`` and the
``tinker`` CLI (``run list``, ``checkpoint list``, ``checkpoint download``) call.

A training run here is a run the Tinker API created (its config carries the ``tinker.*``
labels), active or finished: a finished session's runs are evicted but keep their checkpoints
until the run is deleted. Checkpoints come from the trainer's ``checkpoints`` command: saved
states (``tinker://<run>/weights/<name>``), exports (``.../external_weights/<name>``) and
sampler saves (``.../sampler_weights/<name>@<step>``). Every route acts for the caller's tenant
only: a run of another tenant is a 404 that names no owner, as is one that does not exist.

Downloads: ``external_weights_urls`` (what ``tinker checkpoint download`` fetches) gives one
signed URL per file of the PEFT adapter, ``archive`` one for a tar of it (a redirect, and the
URL in the body); see :mod:`services.gateway.downloads`. Publishing a checkpoint to other
tenants is refused: each tenant's checkpoints are its own.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from schemas.events import RunRow
from schemas.training import CheckpointInfo
from services.gateway import downloads
from services.gateway.app import Gateway, Scope, gateway_of, parse_body, read_json
from services.gateway.backend import GatewayError
from services.gateway.sessions import SESSION_LABEL
from services.gateway.tinker_bodies import Body, PathBody
from services.gateway.tinker_sessions import page
from services.gateway.tinker_states import EXTERNAL, checkpoints, parse_state_path, state_of
from services.gateway.tinker_training import BASE_LABEL, RANK_LABEL, USER_LABEL

router = APIRouter(prefix="/api/v1")

KINDS = {"weights": "training", "external_weights": "external", "sampler_weights": "sampler"}
"""a tinker path's segment -> its checkpoint type"""


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=UTC).isoformat()


def checkpoint_json(run_id: str, c: CheckpointInfo) -> dict[str, Any]:
    """A checkpoint as the SDK's ``Checkpoint``."""
    if c.kind == "sampler":
        segment, name = "sampler_weights", f"{c.name}@{c.step}"
    elif c.name.startswith(EXTERNAL):
        segment, name = "external_weights", c.name.removeprefix(EXTERNAL)
    else:
        segment, name = "weights", c.name
    return {
        "checkpoint_id": f"{segment}/{name}",
        "checkpoint_type": KINDS[segment],
        "time": _iso(c.created_at),
        "tinker_path": f"tinker://{run_id}/{segment}/{name}",
        "size_bytes": c.size_bytes or None,
        "public": False,
        "expires_at": _iso(c.expires_at) if c.expires_at else None,
    }


def is_tinker_run(row: RunRow, tenant: str) -> bool:
    return (
        row.tenant == tenant
        and row.status in ("active", "waiting", "evicted")
        and (SESSION_LABEL in row.labels or BASE_LABEL in row.labels)
    )


async def tinker_run(gateway: Scope, run_id: str) -> RunRow:
    """The caller's Tinker run ``run_id``; 404 for any other (whoever owns it)."""
    row = await gateway.backend.run(run_id)
    if row is None or not is_tinker_run(row, gateway.tenant):
        raise GatewayError(404, f"unknown training run {run_id!r}")
    return row


async def run_json(gateway: Scope, row: RunRow, detail: bool) -> dict[str, Any]:
    """A run as the SDK's ``TrainingRun`` (with ``detail``, its newest checkpoints too)."""
    rank = row.labels.get(RANK_LABEL, "")
    out: dict[str, Any] = {
        "training_run_id": row.run_id,
        "base_model": row.labels.get(BASE_LABEL) or gateway.settings.base_name(),
        "model_owner": row.tenant,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": int(rank) if rank.isdigit() else None,
        "last_request_time": _iso(row.updated_at or time.time()),
        "last_checkpoint": None,
        "last_sampler_checkpoint": None,
        "user_metadata": {
            k.removeprefix(USER_LABEL): v for k, v in row.labels.items() if k.startswith(USER_LABEL)
        }
        or None,
    }
    if detail:
        for c in (await checkpoints(gateway, row.run_id, op="list")).checkpoints:
            key = "last_sampler_checkpoint" if c.kind == "sampler" else "last_checkpoint"
            out[key] = checkpoint_json(row.run_id, c)
    return out


# --- training runs ----------------------------------------------------------------------------


@router.get("/training_runs")
async def list_training_runs(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    limit, offset = page(request)
    rows = [r for r in await gateway.backend.runs() if is_tinker_run(r, gateway.tenant)]
    rows.sort(key=lambda r: -r.updated_at)
    shown = [await run_json(gateway, r, False) for r in rows[offset : offset + limit]]
    cursor = {"offset": offset, "limit": limit, "total_count": len(rows)}
    return {"training_runs": shown, "cursor": cursor}


@router.get("/training_runs/{run_id}")
async def get_training_run(request: Request, run_id: str) -> dict[str, Any]:
    gateway = gateway_of(request)
    return await run_json(gateway, await tinker_run(gateway, run_id), True)


@router.delete("/training_runs/{run_id}")
async def delete_training_run(request: Request, run_id: str) -> dict[str, Any]:
    """Evict the run (if it still trains) and delete it with its checkpoints."""
    gateway = gateway_of(request)
    row = await tinker_run(gateway, run_id)
    if row.status != "evicted":
        await gateway.backend.evict(run_id, "deleted through the Tinker API")
        gateway.backend.give_up(run_id)  # deletes it once evicted
    else:
        await gateway.backend.evict(run_id, "deleted through the Tinker API", delete=True)
    return {"training_run_id": run_id, "deleted": True}


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(request: Request, run_id: str) -> dict[str, Any]:
    gateway = gateway_of(request)
    await tinker_run(gateway, run_id)
    found = await checkpoints(gateway, run_id, op="list")
    return {"checkpoints": [checkpoint_json(run_id, c) for c in found.checkpoints]}


@router.get("/checkpoints")
async def list_user_checkpoints(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    limit, offset = page(request)
    listed: list[dict[str, Any]] = []
    for row in await gateway.backend.runs():
        if is_tinker_run(row, gateway.tenant):
            found = await checkpoints(gateway, row.run_id, op="list")
            listed += [checkpoint_json(row.run_id, c) for c in found.checkpoints]
    listed.sort(key=lambda c: c["time"], reverse=True)
    cursor = {"offset": offset, "limit": limit, "total_count": len(listed)}
    return {"checkpoints": listed[offset : offset + limit], "cursor": cursor}


# --- one checkpoint ---------------------------------------------------------------------------


async def _checkpoint(gateway: Scope, run_id: str, segment: str, name: str) -> tuple[str, str]:
    """``(kind, name on disk)`` of the caller's checkpoint ``<segment>/<name>`` of ``run_id``."""
    await tinker_run(gateway, run_id)
    if segment == "sampler_weights":
        return "sampler", name.rpartition("@")[0] or name
    if segment not in KINDS:
        raise GatewayError(404, f"unknown checkpoint {segment}/{name}")
    return "state", parse_state_path(f"tinker://{run_id}/{segment}/{name}")[1]


@router.delete("/training_runs/{run_id}/checkpoints/{segment}/{name}")
async def delete_checkpoint(request: Request, run_id: str, segment: str, name: str) -> Response:
    gateway = gateway_of(request)
    kind, stored = await _checkpoint(gateway, run_id, segment, name)
    await checkpoints(gateway, run_id, op="delete", kind=kind, name=stored)
    return Response(status_code=204)


class TtlBody(Body):
    ttl_seconds: int | None = None


@router.put("/training_runs/{run_id}/checkpoints/{segment}/{name}/ttl")
async def set_checkpoint_ttl(request: Request, run_id: str, segment: str, name: str) -> Response:
    gateway = gateway_of(request)
    ttl = parse_body(TtlBody, await read_json(request)).ttl_seconds
    kind, stored = await _checkpoint(gateway, run_id, segment, name)
    if kind != "state":
        raise GatewayError(400, "sampler saves hold no files of their own; they do not expire")
    if ttl is not None and not 1 <= ttl <= 10 * 366 * 86400:
        raise GatewayError(400, "ttl_seconds must be 1 second to 10 years, or null (never)")
    await checkpoints(gateway, run_id, op="expire", name=stored, ttl_s=float(ttl or 0))
    return Response(status_code=204)


@router.api_route(
    "/training_runs/{run_id}/checkpoints/{segment}/{name}/publish", methods=["POST", "DELETE"]
)
async def publish_checkpoint(request: Request, run_id: str, segment: str, name: str) -> Response:
    gateway = gateway_of(request)
    await _checkpoint(gateway, run_id, segment, name)
    raise GatewayError(
        400,
        "publishing checkpoints is not supported by plexrl: a tenant's checkpoints are its "
        "own; download one (tinker checkpoint download) to share it",
    )


def _grant(gateway: Scope, run_id: str, stored: str, file: str, base: str) -> tuple[str, int]:
    expires = int(time.time() + gateway.settings.download_ttl_s)
    grant = downloads.Grant(gateway.tenant, run_id, stored, file, expires)
    token = downloads.sign(gateway.gateway.url_key, grant)
    return f"{base}api/v1/downloads/{token}/{file or downloads.ARCHIVE}", expires


async def _files(gateway: Scope, run_id: str, segment: str, name: str) -> tuple[str, list[Any]]:
    kind, stored = await _checkpoint(gateway, run_id, segment, name)
    if kind != "state":
        raise GatewayError(400, "sampler checkpoints cannot be downloaded; save_state one")
    return stored, (await state_of(gateway, run_id, stored)).files


@router.get("/training_runs/{run_id}/checkpoints/{segment}/{name}/external_weights_urls")
async def external_weights_urls(
    request: Request, run_id: str, segment: str, name: str
) -> dict[str, Any]:
    gateway = gateway_of(request)
    stored, files = await _files(gateway, run_id, segment, name)
    urls, expires = {}, 0
    for f in files:
        urls[f.path], expires = _grant(gateway, run_id, stored, f.path, str(request.base_url))
    return {"urls": urls, "expires": _iso(expires)}


@router.get("/training_runs/{run_id}/checkpoints/{segment}/{name}/archive")
async def checkpoint_archive(request: Request, run_id: str, segment: str, name: str) -> Response:
    gateway = gateway_of(request)
    stored, _ = await _files(gateway, run_id, segment, name)
    url, expires = _grant(gateway, run_id, stored, "", str(request.base_url))
    body = {"url": url, "expires": _iso(expires)}
    return JSONResponse(body, status_code=302, headers={"Location": url})


@router.post("/weights_info")
async def weights_info(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    path = parse_body(PathBody, await read_json(request)).tinker_path
    run_id, stored = parse_state_path(path)
    row = await tinker_run(gateway, run_id)
    state = await state_of(gateway, run_id, stored)
    return {
        "base_model": row.labels.get(BASE_LABEL) or gateway.settings.base_name(),
        "is_lora": True,
        "lora_rank": state.rank,
        "train_unembed": gateway.settings.train_unembed,
        "train_mlp": True,
        "train_attn": True,
    }


# --- the signed downloads (no API key: the URL is the grant) ----------------------------------


@router.get("/downloads/{token}/{filename}")
async def download(request: Request, token: str, filename: str) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        grant = downloads.verify(gateway.url_key, token)
    except downloads.BadToken as exc:
        raise GatewayError(403, str(exc)) from None
    backend = await gateway.tenancy.backend(grant.tenant)
    scope = Scope(gateway, grant.tenant, backend)
    state = await state_of(scope, grant.run_id, grant.name)

    async def read(file: str, offset: int, length: int) -> bytes:
        done = await checkpoints(
            scope, grant.run_id, op="read", name=grant.name, file=file, offset=offset, length=length
        )
        return done.data

    if grant.file:
        wanted = next((f for f in state.files if f.path == grant.file), None)
        if wanted is None:
            raise GatewayError(404, f"the checkpoint has no file {grant.file!r}")
        body = downloads.file_bytes(read, wanted)
        size = wanted.size_bytes
    else:
        body = downloads.archive_bytes(read, state.files, state.created_at)
        size = downloads.archive_size(state.files)
    headers = {"Content-Length": str(size)}
    return StreamingResponse(body, media_type="application/octet-stream", headers=headers)
