"""The Tinker API's saved states (``/api/v1``): save, save for export, load, and forks.

- ``save_weights`` (``save_state``): a checkpoint of the run's adapter, optimizer and progress,
  ``tinker://<run>/weights/<name>``; an existing name is refused unless ``overwrite``;
  ``ttl_seconds`` deletes it that long after. Names starting ``external.`` are reserved.
- ``save_weights_external``: the same, listed as ``tinker://<run>/external_weights/<name>``
  (a PEFT adapter ``tinker checkpoint download`` fetches file by file).
- ``load_weights`` on a training client (``load_state``, ``load_state_with_optimizer``): a
  checkpoint of this run or of another run of the caller's tenant (same rank).
- ``load_weights`` without a model (``create_training_client_from_state`` and
  ``..._with_optimizer``): a **fork**, a new run (its id derived from the session and
  ``model_seq_id``, like ``create_model``'s) of the checkpoint's rank, in the caller's session,
  that starts from the checkpoint; with the optimizer, from its step too.

A checkpoint of another tenant's run is a 404 that names no owner, as is one that does not
exist.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request

from schemas.training import (
    CheckpointInfo,
    CheckpointsRequest,
    CheckpointsResult,
    LoadWeightsRequest,
    LoadWeightsResult,
    SaveWeightsRequest,
    SaveWeightsResult,
)
from services.gateway.app import Scope, gateway_of, parse_body, read_json
from services.gateway.backend import GatewayError, new_request_id, run_id_for
from services.gateway.futures import Outcome
from services.gateway.observe import note_run
from services.gateway.tinker_api import check_base
from services.gateway.tinker_bodies import LoadWeightsBody, SaveWeightsBody
from services.gateway.tinker_training import (
    _future_id,
    _model_id,
    _name,
    _refused,
    created,
    run_config,
    run_labels,
)

router = APIRouter(prefix="/api/v1")

EXTERNAL = "external."
"""the prefix of the checkpoint directories of ``save_weights_external``"""
_PATH = re.compile(
    r"^tinker://(run_[A-Za-z0-9_-]{1,64})/(weights|external_weights)/([A-Za-z0-9_.-]{1,128})$"
)


def parse_state_path(path: str) -> tuple[str, str]:
    """``(run_id, checkpoint name on disk)`` of a ``tinker://<run>/weights/<name>`` path (or
    ``external_weights``); a 400 for anything else."""
    match = _PATH.match(path)
    if match is None:
        raise GatewayError(
            400,
            f"{path!r} is not a saved state (tinker://<run>/weights/<name>, from save_state)",
        )
    run_id, kind, name = match.groups()
    return run_id, (EXTERNAL + name if kind == "external_weights" else name)


async def checkpoints(gateway: Scope, run_id: str, **request: Any) -> CheckpointsResult:
    """The trainer's ``checkpoints`` command for one of the caller's runs; its error is a 404
    (unknown run or checkpoint: the same answer whoever owns it) or a 400."""
    req = CheckpointsRequest(request_id=new_request_id("ck"), run_id=run_id, **request)
    result = await gateway.backend.train("checkpoints", req, CheckpointsResult)
    if result.error is not None:
        missing = result.error.startswith("unknown run") or " has no " in result.error
        raise GatewayError(404 if missing else 400, result.error)
    return result


async def state_of(gateway: Scope, run_id: str, name: str) -> CheckpointInfo:
    """The saved state ``name`` of the caller's run ``run_id``; 404 when there is none."""
    found = await checkpoints(gateway, run_id, op="list", kind="state", name=name)
    if not found.checkpoints:
        raise GatewayError(404, f"{run_id} has no saved state named {name!r}")
    return found.checkpoints[0]


async def _save(gateway: Scope, rid: str, model_id: str, name: str, body: SaveWeightsBody) -> str:
    """Save the run's state as ``name`` (empty: its regular ``step_<n>``); the name saved."""
    command = SaveWeightsRequest(
        request_id=rid, run_id=model_id, kind="state", name=name, overwrite=body.overwrite
    )
    result = await gateway.backend.train("save_weights", command, SaveWeightsResult)
    _refused(result.error)
    if body.ttl_seconds is not None:
        await checkpoints(gateway, model_id, op="expire", name=result.path, ttl_s=body.ttl_seconds)
    return result.path


@router.post("/save_weights")
async def save_weights(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    body = parse_body(SaveWeightsBody, await read_json(request))
    model_id = _model_id(body.model_id)
    note_run(request, model_id)
    name = _name(body.path, "")
    if name.startswith(EXTERNAL):
        raise GatewayError(400, f"checkpoint names starting {EXTERNAL!r} are reserved")

    async def work() -> Outcome:
        saved = await _save(gateway, rid, model_id, name, body)
        return Outcome(
            body={"path": f"tinker://{model_id}/weights/{saved}", "type": "save_weights"}
        )

    rid = _future_id("save_weights", model_id, body.seq_id)
    future_id = gateway.futures.start(rid, work, order=model_id)
    return {"request_id": future_id, "model_id": model_id}


@router.post("/save_weights_external")
async def save_weights_external(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    body = parse_body(SaveWeightsBody, await read_json(request))
    model_id = _model_id(body.model_id)
    note_run(request, model_id)
    name = _name(body.path, "")
    if not name:
        raise GatewayError(400, "save_weights_external needs a name (path)")
    if len(EXTERNAL + name) > 128:
        raise GatewayError(400, f"the name {name!r} is too long (at most {128 - len(EXTERNAL)})")
    body = body.model_copy(update={"overwrite": True})

    async def work() -> Outcome:
        await _save(gateway, rid, model_id, EXTERNAL + name, body)
        path = f"tinker://{model_id}/external_weights/{name}"
        return Outcome(body={"path": path, "type": "save_weights_external"})

    rid = _future_id("save_weights_external", model_id, body.seq_id)
    future_id = gateway.futures.start(rid, work, order=model_id)
    return {"request_id": future_id, "model_id": model_id}


@router.post("/load_weights")
async def load_weights(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    body = parse_body(LoadWeightsBody, await read_json(request))
    source, name = parse_state_path(body.path or "")
    if body.model_id:
        model_id = _model_id(body.model_id)
        fork = False
    elif body.session_id and body.model_seq_id is not None:
        model_id, fork = run_id_for(body.session_id, body.model_seq_id), True
        check_base(gateway, body.base_model or gateway.settings.base_name())
        if body.optimizer_config is not None and body.optimizer_config.type != "adamw":
            raise GatewayError(400, "plexrl uses AdamW: optimizer_config must be adamw")
    else:
        raise GatewayError(
            400, "load_weights needs a model_id, or a session_id and model_seq_id (a new run)"
        )
    note_run(request, model_id)
    path = body.path or ""

    async def work() -> Outcome:
        if fork:
            state = await state_of(gateway, source, name)
            labels = run_labels(gateway, body.session_id or "", state.rank, body.user_metadata)
            labels["tinker.fork_of"] = f"{source}/{name}"[:1024]
            config = run_config(state.rank, state.alpha, None, labels)
            await created(gateway, model_id, config, body.session_id or "")
        command = LoadWeightsRequest(
            request_id=rid,
            run_id=model_id,
            path=name,
            optimizer=body.optimizer,
            source_run_id=None if source == model_id else source,
        )
        result = await gateway.backend.train("load_weights", command, LoadWeightsResult)
        if result.error is not None and result.error.startswith("unknown run"):
            raise GatewayError(404, result.error)
        _refused(result.error)
        return Outcome(body={"path": path, "model_id": model_id, "type": "load_weights"})

    rid = _future_id("load_weights", model_id, body.seq_id)
    future_id = gateway.futures.start(rid, work, order=model_id)
    return {"request_id": future_id, "model_id": model_id}
