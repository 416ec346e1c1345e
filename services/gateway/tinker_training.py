"""The Tinker API, part two: training clients (``/api/v1``).

- ``create_model``: a LoRA training client becomes a plexrl run, submitted to the registry with
  ``driver = "commands"`` and the requested rank (quotas and refusals are the registry's). Its
  id is derived from the session and the client's ``model_seq_id``, so a resent request finds
  the same run. The run's LoRA targets are the trainer's (``--target-modules``); a client that
  asks to leave out the MLP, attention or unembedding layers is refused.
- ``get_info``: the base model, and the model directory as the tokenizer id (the SDK loads it
  from that path, offline).
- ``forward_backward`` (protobuf in, protobuf out; ``forward`` is the same request with
  ``forward_only``), ``optim_step``, ``save_weights_for_sampler``, ``save_weights``,
  ``load_weights``: one training command each (:mod:`schemas.training`), sent as a future of
  the model, in the order the client sent them. The command's ``request_id`` is the future's
  id, built from the model and the request's ``seq_id``: a resent request is applied once.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import msgspec
from fastapi import APIRouter, Request

from schemas.training import (
    LOSS_FN_INPUT_KEYS,
    LOSS_FNS,
    AdamParams,
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    OptimStepRequest,
    OptimStepResult,
    SaveWeightsRequest,
    SaveWeightsResult,
)
from services.gateway import wire
from services.gateway.app import Scope, gateway_of, parse_body, read_body, read_json
from services.gateway.backend import (
    RUN_ID,
    GatewayError,
    ModelRef,
    commands_config,
    config_digest,
    run_id_for,
    sdk_model_run,
)
from services.gateway.futures import Outcome
from services.gateway.observe import note_run
from services.gateway.sessions import SESSION_LABEL
from services.gateway.tinker_api import check_base, sampler_id, sampler_path
from services.gateway.tinker_bodies import (
    CreateModelBody,
    ModelBody,
    OptimStepBody,
    SaveWeightsBody,
)

router = APIRouter(prefix="/api/v1")

LORA_ALPHA = 32.0
"""Tinker's LoRA scale: alpha 32 at every rank."""
BASE_LABEL = "tinker.base_model"
RANK_LABEL = "tinker.rank"
USER_LABEL = "user."
"""labels of a Tinker run's config: its base model's name, its rank, the user's metadata"""
_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def _model_id(model_id: str | None) -> str:
    """The run a request's ``model_id`` names: the run id ``create_model`` answered, or the id
    the SDK derives itself (``<session>:train:<model_seq_id>``) for the same run."""
    model_id = sdk_model_run(model_id or "")
    if not RUN_ID.match(model_id):
        raise GatewayError(404, f"unknown model {model_id!r}")
    return model_id


def _future_id(kind: str, model_id: str, seq: int | None) -> str:
    if seq is None:
        return f"{kind}:{model_id}:{uuid.uuid4().hex}"
    return f"{kind}:{model_id}:{seq}"


# The SDK combines the metrics of a call's chunks by the reduction each key names after a colon
# ("loss:sum"); a trainer metric that names none is averaged.


def _refused(error: str | None) -> None:
    if error is not None:
        raise GatewayError(400, error)


# --- models -----------------------------------------------------------------------------------


def check_targets(gateway: Scope, mlp: bool, attn: bool, unembed: bool) -> None:
    """Refuse LoRA targets other than the deployment's, which every run shares."""
    left_out = [k for k, on in (("train_mlp", mlp), ("train_attn", attn)) if not on]
    if unembed != gateway.settings.train_unembed:
        if unembed:
            raise GatewayError(
                400,
                "train_unembed = True: this deployment puts no LoRA on the unembedding "
                "(lm_head); pass train_unembed=False, or run the trainer and inference with "
                "lm_head among --target-modules and the gateway with --train-unembed (plexrl "
                "up --gateway does)",
            )
        left_out.append("train_unembed")
    if left_out:
        raise GatewayError(
            400,
            f"{', '.join(left_out)} = False: plexrl trains the LoRA targets the trainer was "
            "started with (--target-modules) for every run",
        )


def run_labels(
    gateway: Scope, session_id: str, rank: int, user_metadata: dict[str, Any] | None
) -> dict[str, str]:
    """What a Tinker run records in its config's labels: its session, base model, rank, and
    the user's metadata (``user.<key>``)."""
    metadata = {str(k): str(v) for k, v in (user_metadata or {}).items()}
    too_long = [k for k, v in metadata.items() if len(k) > 120 or len(v) > 1024]
    if too_long or len(metadata) > 48:
        raise GatewayError(
            400, "user_metadata: at most 48 entries, keys of 120 and values of 1024 characters"
        )
    labels = {
        SESSION_LABEL: session_id[:1024],
        BASE_LABEL: gateway.settings.base_name()[:1024],
        RANK_LABEL: str(rank),
    }
    return labels | {f"{USER_LABEL}{k}": v for k, v in metadata.items()}


def run_config(rank: int, alpha: float, seed: int | None, labels: dict[str, str]) -> dict[str, Any]:
    """The config of a run trained by Tinker's commands."""
    config: dict[str, Any] = {
        "env": "reverse",
        "max_steps": 10_000_000,
        "model": {"lora": {"rank": rank, "alpha": alpha}},
        "labels": labels,
    }
    if seed is not None:
        config["seed"] = seed
    return commands_config(config)


async def created(gateway: Scope, run_id: str, config: dict[str, Any], session_id: str) -> None:
    """Submit ``run_id`` with ``config`` unless it is active with it already, and record it in
    its session (whose end evicts it)."""
    digest = config_digest(config)
    gateway.sessions.add_run(gateway.tenant, session_id, run_id)
    row = await gateway.backend.run(run_id)
    # Active with another config: the id was taken with another rank or seed. Submitting
    # makes the registry refuse it (and tell its operators); waiting then answers the 400.
    if row is None or row.status != "active" or row.config_digest not in ("", digest):
        await gateway.backend.submit(run_id, config, "gateway")


@router.post("/create_model")
async def create_model(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    body = parse_body(CreateModelBody, await read_json(request))
    check_base(gateway, body.base_model)
    lora = body.lora_config
    if lora is None:
        raise GatewayError(400, "plexrl trains LoRA adapters: create_model needs a lora_config")
    check_targets(gateway, lora.train_mlp, lora.train_attn, lora.train_unembed)
    optimizer = body.optimizer_config.type if body.optimizer_config else "adamw"
    if optimizer != "adamw":
        raise GatewayError(400, f"optimizer {optimizer!r} is not supported; plexrl uses AdamW")
    run_id = run_id_for(body.session_id, body.model_seq_id)
    labels = run_labels(gateway, body.session_id, lora.rank, body.user_metadata)
    wanted = run_config(lora.rank, LORA_ALPHA, lora.seed, labels)
    digest = config_digest(wanted)

    async def work() -> Outcome:
        await created(gateway, run_id, wanted, body.session_id)
        return Outcome(body={"model_id": run_id, "type": "create_model"})

    # A resent request is the same future; the same model id with another config is another.
    key = f"create_model:{run_id}:{digest.removeprefix('sha256:')[:16]}"
    request_id = gateway.futures.start(key, work, order=run_id)
    return {"request_id": request_id, "model_id": run_id}


@router.post("/get_info")
async def get_info(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    model_id = _model_id(parse_body(ModelBody, await read_json(request)).model_id)
    note_run(request, model_id)
    row = await gateway.backend.run(model_id)
    if row is None or row.status != "active" or row.tenant != gateway.tenant:
        raise GatewayError(404, f"model {model_id!r} is not an active run")
    base = gateway.settings.base_name()
    rank = row.labels.get(RANK_LABEL, "")
    return {
        "type": "get_info",
        "model_data": {
            "arch": gateway.codec.arch or None,
            "model_name": base,
            "tokenizer_id": gateway.settings.tokenizer_id(),
        },
        "model_id": model_id,
        "is_lora": True,
        "lora_rank": int(rank) if rank.isdigit() else None,
        "model_name": base,
    }


# --- training commands ------------------------------------------------------------------------


def _datum(d: wire.FwdBwdDatum, loss_fn: str) -> Datum:
    missing = [
        k for k in LOSS_FN_INPUT_KEYS[loss_fn] if k not in d.loss_fn_inputs and k != "weights"
    ]
    if missing:
        raise GatewayError(400, f"loss_fn {loss_fn!r} needs loss_fn_inputs {missing}")
    return Datum(model_input=d.tokens, loss_fn_inputs=d.loss_fn_inputs)


@router.post("/forward_backward")
async def forward_backward(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    if request.headers.get("content-encoding", "identity") != "identity":
        raise GatewayError(415, "send forward_backward uncompressed (no Content-Encoding)")
    try:
        req = wire.decode_forward_backward(
            await read_body(request, gateway.settings.max_body_bytes)
        )
    except wire.WireError as exc:
        raise GatewayError(400, f"forward_backward: not a ForwardBackwardRequest: {exc}") from exc
    model_id = _model_id(req.model_id)
    note_run(request, model_id)
    kind = "forward" if req.forward_only else "forward_backward"

    async def work() -> Outcome:
        if req.loss_fn not in LOSS_FNS:
            raise GatewayError(
                400,
                f"loss_fn {req.loss_fn!r} is not supported by plexrl; use one of "
                f"{', '.join(LOSS_FNS)}",
            )
        if not req.data:
            raise GatewayError(400, "forward_backward needs at least one datum")
        context = gateway.codec.context_len
        for i, d in enumerate(req.data):
            if len(d.tokens) > context:
                raise GatewayError(
                    400,
                    f"data[{i}] has {len(d.tokens)} input tokens, more than the model's context "
                    f"of {context}; split or truncate it",
                )
        command = ForwardBackwardRequest(
            request_id=request_id,
            run_id=model_id,
            data=[_datum(d, req.loss_fn) for d in req.data],
            loss_fn=req.loss_fn,
            loss_fn_config=req.loss_fn_config or None,
            forward_only=req.forward_only,
        )
        result = await gateway.backend.train("forward_backward", command, ForwardBackwardResult)
        _refused(result.error)
        metrics = {k if ":" in k else f"{k}:mean": v for k, v in result.metrics.items()}
        return Outcome(proto=wire.encode_forward_backward_output(result.loss_fn_outputs, metrics))

    request_id = _future_id(kind, model_id, req.seq_id or None)
    future_id = gateway.futures.start(request_id, work, order=model_id)
    return {"request_id": future_id, "model_id": model_id}


@router.post("/optim_step")
async def optim_step(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    body = parse_body(OptimStepBody, await read_json(request))
    model_id = _model_id(body.model_id)
    note_run(request, model_id)
    if body.adam_params is None:
        raise GatewayError(400, "plexrl steps AdamW: optim_step needs adam_params")
    fields = set(AdamParams.__struct_fields__)
    try:
        adam = msgspec.convert(
            {k: v for k, v in body.adam_params.items() if k in fields}, AdamParams
        )
    except msgspec.ValidationError as exc:
        raise GatewayError(400, f"adam_params: {exc}") from exc

    async def work() -> Outcome:
        command = OptimStepRequest(request_id=rid, run_id=model_id, adam_params=adam)
        result = await gateway.backend.train("optim_step", command, OptimStepResult)
        _refused(result.error)
        return Outcome(body={"metrics": result.metrics, "type": "optim_step"})

    rid = _future_id("optim_step", model_id, body.seq_id)
    future_id = gateway.futures.start(rid, work, order=model_id)
    return {"request_id": future_id, "model_id": model_id}


def _name(path: str | None, default: str) -> str:
    return _NAME.sub("_", path or "")[:128] or default


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    body = parse_body(SaveWeightsBody, await read_json(request))
    model_id = _model_id(body.model_id)
    note_run(request, model_id)
    wants_session = not body.path and body.sampling_session_seq_id is not None
    name = _name(body.path, "sampler")

    async def work() -> Outcome:
        command = SaveWeightsRequest(request_id=rid, run_id=model_id, kind="sampler", name=name)
        result = await gateway.backend.train("save_weights", command, SaveWeightsResult)
        _refused(result.error)
        out: dict[str, Any] = {
            "path": sampler_path(model_id, name, result.step),
            "type": "save_weights_for_sampler",
        }
        if wants_session:
            out["sampling_session_id"] = sampler_id(ModelRef(model_id, result.step, exact=True))
        return Outcome(body=out)

    rid = _future_id("save_weights_for_sampler", model_id, body.seq_id)
    future_id = gateway.futures.start(rid, work, order=model_id)
    return {"request_id": future_id, "model_id": model_id}
