"""The Tinker API's sessions, training runs, checkpoints, forks, snapshots and downloads on the
keyed deployment: globex, with a valid key of its own, aims at each route with acme's run,
checkpoint, session and sampler, and gets a 404 (or a 401 without a key) that names no owner,
while everything of acme's stays as it was and keeps working."""

from __future__ import annotations

import time

import httpx
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.timeout(300)
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints([1, 5, 6, 7]),
        loss_fn_inputs={"target_tokens": [5, 6, 7, 2]},
    )
]


def _acme(deployment) -> tuple[tinker.ServiceClient, tinker.TrainingClient, str, str]:
    service = tinker.ServiceClient(base_url=deployment.gateway, api_key=deployment.key("acme"))
    trainer = service.create_lora_training_client("tiny-base", rank=4, train_unembed=False).result()
    trainer.forward_backward(DATA, "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    state = trainer.save_state("secret").result(timeout=120).path
    sampler = trainer.save_weights_for_sampler("snap").result(timeout=120).path
    return service, trainer, state, sampler


def _state_of(deployment, trainer, run_id: str) -> tuple[object, ...]:
    rest = tinker.RestClient(base_url=deployment.gateway, api_key=deployment.key("acme"))
    listed = rest.list_checkpoints(run_id).result().checkpoints
    loss = trainer.forward(DATA, "cross_entropy").result(timeout=120).metrics["loss:sum"]
    return tuple(sorted(c.tinker_path for c in listed)), round(loss, 6)


def test_another_tenant_reaches_no_session_run_checkpoint_or_download_of_acmes(deployment) -> None:
    service, trainer, state, sampler_path = _acme(deployment)
    run = trainer.model_id
    session = service.holder.get_session_id()
    before = _state_of(deployment, trainer, run)
    mine = {"X-API-Key": deployment.key("globex")}
    ckpt = f"/api/v1/training_runs/{run}/checkpoints/weights/secret"
    refused = [
        ("GET", f"/api/v1/training_runs/{run}", None),
        ("DELETE", f"/api/v1/training_runs/{run}", None),
        ("GET", f"/api/v1/training_runs/{run}/checkpoints", None),
        ("DELETE", ckpt, None),
        ("PUT", f"{ckpt}/ttl", {"ttl_seconds": 3600}),
        ("POST", f"{ckpt}/publish", None),
        ("GET", f"{ckpt}/external_weights_urls", None),
        ("GET", f"{ckpt}/archive", None),
        ("POST", "/api/v1/weights_info", {"tinker_path": state}),
        ("GET", f"/api/v1/sessions/{session}", None),
        ("POST", "/api/v1/create_sampling_session", {"model_path": sampler_path}),
    ]
    with httpx.Client(base_url=deployment.gateway, timeout=60, follow_redirects=False) as http:
        for method, path, body in refused:
            answer = http.request(method, path, json=body, headers=mine)
            assert answer.status_code == 404, (method, path, answer.text)
            assert "acme" not in answer.text, answer.text
            assert http.request(method, path, json=body).status_code == 401  # no key at all
        listed = http.get("/api/v1/training_runs", headers=mine).json()["training_runs"]
        assert run not in [r["training_run_id"] for r in listed]
        assert http.get("/api/v1/checkpoints", headers=mine).json()["checkpoints"] == []
        # globex's heartbeat and finish of acme's session id touch a session of globex's own
        beat = {"session_id": session}
        assert http.post("/api/v1/session_heartbeat", json=beat, headers=mine).is_success
        assert http.post(f"/api/v1/sessions/{session}/finish", json={}, headers=mine).is_success
        acme_key = {"X-API-Key": deployment.key("acme")}
        assert http.post("/api/v1/session_heartbeat", json=beat, headers=acme_key).is_success
        # a fork of acme's saved state: the future fails, as for a state that does not exist
        fork = http.post(
            "/api/v1/load_weights",
            json={"session_id": "g", "model_seq_id": 0, "path": state, "optimizer": True},
            headers=mine,
        ).json()
        outcome = {"type": "try_again"}
        deadline = time.monotonic() + 60
        while outcome.get("type") == "try_again" and time.monotonic() < deadline:
            outcome = http.post(
                "/api/v1/retrieve_future", json={"request_id": fork["request_id"]}, headers=mine
            ).json()
        assert outcome.get("category") == "user" and "acme" not in str(outcome), outcome
        assert "unknown" in outcome["error"] or "has no saved state" in outcome["error"]
        # acme's own download URL works; one globex made up does not
        pointer = http.get(f"{ckpt}/archive", headers={"X-API-Key": deployment.key("acme")})
        assert pointer.status_code == 302
        assert http.get(pointer.json()["url"]).status_code == 200
        forged = pointer.json()["url"].replace("/downloads/", "/downloads/A")
        assert http.get(forged).status_code == 403
    # acme's run trains on as before, its checkpoints and state unchanged
    assert _state_of(deployment, trainer, run) == before
    trainer.forward_backward(DATA, "cross_entropy").result(timeout=120)
    service.close("success").result()
