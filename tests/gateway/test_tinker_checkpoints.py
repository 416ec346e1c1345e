"""Saved states through the stock ``tinker`` SDK, RestClient and CLI against the shared stack:
forks start where their parent was, checkpoints are listed, expired, deleted and downloaded as
a PEFT adapter that ``peft`` loads and that computes what the trainer computes, sessions end with
their ``with`` block, and what the SDK documents about names, sizes and targets holds."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import time

import httpx
import pytest
import tinker
import torch
from gateway_support import REPO
from test_tinker import _sft_datum
from tinker import types

from services.model.loader import load_tokenizer

pytestmark = pytest.mark.timeout(300)
KEY = "tml-plexrl-test"
BATCH = [("abc", "cba"), ("hey", "yeh")]


@pytest.fixture(scope="module")
def tok(stack):
    return load_tokenizer(stack.model)


def _batch(tok) -> list[types.Datum]:
    return [_sft_datum(tok, p, a) for p, a in BATCH]


def _step(trainer, tok, lr: float = 3e-2) -> float:
    fb = trainer.forward_backward(_batch(tok), "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=lr)).result(timeout=120)
    return fb.result(timeout=120).metrics["loss:sum"]


def _loss(trainer, tok) -> float:
    return trainer.forward(_batch(tok), "cross_entropy").result(timeout=120).metrics["loss:sum"]


def _status(stack, run_id: str) -> str | None:
    return {m["id"]: "active" for m in httpx.get(f"{stack.url}/v1/models").json()["data"]}.get(
        run_id
    )


def _evicted(stack, *run_ids: str, timeout: float = 30.0) -> bool:
    """Whether every run left the active ones within ``timeout`` (eviction takes a moment)."""
    deadline = time.monotonic() + timeout
    while any(_status(stack, r) for r in run_ids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_forks_start_from_the_saved_state_and_sessions_end_with_their_block(stack, tok) -> None:
    with tinker.ServiceClient(base_url=stack.url, api_key=KEY) as service:
        parent = service.create_lora_training_client(base_model="tiny-base", rank=8).result()
        for _ in range(2):
            _step(parent, tok)
        path = parent.save_state("two").result(timeout=120).path
        assert path == f"tinker://{parent.model_id}/weights/two"
        at_state = _loss(parent, tok)
        parent_next = _step(parent, tok)  # the parent's own next step, from the state
        after_parent = _loss(parent, tok)

        weights_only = service.create_training_client_from_state(path).result()
        assert weights_only.model_id != parent.model_id
        assert _step(weights_only, tok) == pytest.approx(at_state, abs=1e-5)
        resumed = service.create_training_client_from_state_with_optimizer(path).result()
        assert _step(resumed, tok) == pytest.approx(parent_next, abs=1e-5)
        # with AdamW's moments and step restored, its first update is the parent's
        assert _loss(resumed, tok) == pytest.approx(after_parent, abs=1e-5)
        info = resumed.get_info()
        assert (info.lora_rank, info.model_name) == (8, "tiny-base")
        assert info.model_data.arch == "LlamaForCausalLM"
        # the SDK names a client it made from a state <session>:train:<n>; get_info, the run
        runs = [c.get_info().model_id for c in (parent, weights_only, resumed)]
        assert [_status(stack, r) for r in runs] == ["active"] * 3, runs
    # the block ended the session: its three runs were evicted, their slots are free
    assert _evicted(stack, *runs)
    rest = tinker.RestClient(base_url=stack.url, api_key=KEY)
    listed = rest.list_checkpoints(parent.model_id).result()
    assert [c.tinker_path for c in listed.checkpoints if c.checkpoint_type == "training"] == [path]


def test_checkpoints_are_listed_expired_deleted_and_downloaded(stack, tok, tmp_path) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    service = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
    trainer = service.create_lora_training_client(
        base_model="tiny-base", rank=4, user_metadata={"project": "docs"}
    ).result()
    _step(trainer, tok)
    saved = trainer.save_state("kept").result(timeout=120).path
    with pytest.raises(tinker.RequestFailedError, match="already has a checkpoint named 'kept'"):
        trainer.save_state("kept").result(timeout=120)  # overwrite=False, the SDK's default
    assert trainer.save_state("kept", overwrite=True).result(timeout=120).path == saved
    gone = trainer.save_state("brief", ttl_seconds=3600).result(timeout=120).path
    sampler_path = trainer.save_weights_for_sampler("snap").result(timeout=120).path

    rest = tinker.RestClient(base_url=stack.url, api_key=KEY)
    listed = {
        c.tinker_path: c for c in rest.list_checkpoints(trainer.model_id).result().checkpoints
    }
    assert set(listed) == {saved, gone, sampler_path}
    assert listed[gone].expires_at is not None and listed[saved].expires_at is None
    assert listed[sampler_path].checkpoint_type == "sampler"
    run = rest.get_training_run(trainer.model_id).result()
    assert (run.lora_rank, run.base_model, run.user_metadata) == (
        4,
        "tiny-base",
        {"project": "docs"},
    )
    assert (
        run.last_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == sampler_path
    )
    assert trainer.model_id in [
        r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs
    ]
    info = rest.get_weights_info_by_tinker_path(saved).result()
    assert (info.base_model, info.lora_rank, info.train_unembed) == ("tiny-base", 4, True)
    rest.delete_checkpoint_from_tinker_path(gone).result()
    listed_now = [
        c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints
    ]
    assert gone not in listed_now and saved in listed_now

    # the archive: a PEFT adapter whose forward is the trainer's
    ckpt = "weights/kept"
    pointer = httpx.get(
        f"{stack.url}/api/v1/training_runs/{trainer.model_id}/checkpoints/{ckpt}/archive"
    )
    assert pointer.status_code == 302 and pointer.headers["location"] == pointer.json()["url"]
    archive = httpx.get(pointer.json()["url"], timeout=60)  # no API key: the URL is the grant
    assert archive.status_code == 200
    target = tmp_path / "adapter"
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
        tar.extractall(target, filter="data")
    base = AutoModelForCausalLM.from_pretrained(stack.model, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, target).eval()
    ids = [tok.bos_token_id, *tok.encode("abcd", add_special_tokens=False)]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    peft_lp = (
        torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    )
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=ids[1:], dtype="int64", shape=[len(ids) - 1])
        },
    )
    trained = (
        trainer.forward([datum], "cross_entropy").result(timeout=120).loss_fn_outputs[0]["logprobs"]
    )
    assert peft_lp.tolist() == pytest.approx(trained.tolist(), abs=1e-4)
    forged = pointer.json()["url"].replace("/downloads/", "/downloads/x")
    assert httpx.get(forged).status_code == 403

    # the tinker CLI: run list, checkpoint list, checkpoint download (a fork, exported)
    env = os.environ | {"TINKER_BASE_URL": stack.url, "TINKER_API_KEY": KEY}

    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "tinker.cli", *args],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    assert trainer.model_id in cli("run", "list")
    assert "weights/kept" in cli("checkpoint", "list", "--run-id", trainer.model_id)
    cli("checkpoint", "download", saved, "--output", str(tmp_path / "cli"), "--force")
    files = sorted(p.name for p in (tmp_path / "cli").rglob("*") if p.is_file())
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    service.close("success").result()


def test_what_the_sdk_documents_holds_or_is_refused(stack, tok) -> None:
    service = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
    with pytest.raises(tinker.BadRequestError, match="train_unembed = False"):
        service.create_lora_training_client(
            base_model="tiny-base", rank=4, train_unembed=False
        ).result()
    trainer = service.create_lora_training_client(
        base_model="tiny-base", rank=32
    ).result()  # Tinker's
    too_long = [tok.bos_token_id] + [5] * 300  # the tiny model's context is 256
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(too_long[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(
                data=too_long[1:], dtype="int64", shape=[len(too_long) - 1]
            )
        },
    )
    with pytest.raises(tinker.RequestFailedError, match="more than the model's context of 256"):
        trainer.forward_backward([datum], "cross_entropy").result(timeout=60)
    sampler = service.create_sampling_client(base_model="tiny-base").result()
    long_prompt = types.ModelInput.from_ints([tok.bos_token_id] + [5] * 250)
    with pytest.raises(tinker.BadRequestError, match="exceeds the model's context of 256"):
        sampler.sample(long_prompt, 1, types.SamplingParams(max_tokens=10)).result(timeout=60)
    # without max_tokens: what the context leaves
    [seq] = (
        sampler.sample(long_prompt, 1, types.SamplingParams(stop=[], seed=1))
        .result(timeout=60)
        .sequences
    )
    assert len(seq.tokens) == 256 - 251
    service.close("success").result()
    assert _evicted(stack, trainer.model_id)
