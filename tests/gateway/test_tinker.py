"""The Tinker API, driven by the real ``tinker`` SDK against a gateway on loopback (registry,
trainer, inference and gateway processes on a real nats-server, the tiny model)."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import tinker
from gateway_support import evict_runs
from tinker import types

from services.model.loader import load_tokenizer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def service(stack) -> Iterator[tinker.ServiceClient]:
    """One Tinker session for the module, ended when it is done: its runs give their slots
    back to the stack's other tests at once, not when the session expires."""
    with tinker.ServiceClient(base_url=stack.url, api_key="tml-plexrl-test") as s:
        yield s


@pytest.fixture(scope="module")
def tok(stack):
    return load_tokenizer(stack.model)


def _sft_datum(tok, prompt: str, answer: str) -> types.Datum:
    """Next-token cross-entropy on ``answer`` after ``prompt`` (the prompt is not scored)."""
    p = [tok.bos_token_id, *tok.encode(prompt, add_special_tokens=False)]
    a = [*tok.encode(answer, add_special_tokens=False), tok.eos_token_id]
    tokens = p + a
    weights = [0.0] * (len(p) - 1) + [1.0] * len(a)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(
                data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]
            ),
            "weights": types.TensorData(data=weights, dtype="float32", shape=[len(weights)]),
        },
    )


def test_capabilities_name_the_served_base_model(stack) -> None:
    rest = tinker.RestClient(base_url=stack.url, api_key="tml-plexrl-test")
    caps = rest.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == ["tiny-base"]


def test_sampling_the_base_model(service, tok) -> None:
    sampler = service.create_sampling_client(base_model="tiny-base").result()
    prompt = types.ModelInput.from_ints(
        [tok.bos_token_id, *tok.encode("abc", add_special_tokens=False)]
    )
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=4)
    first = sampler.sample(prompt=prompt, num_samples=3, sampling_params=params).result()
    again = sampler.sample(prompt=prompt, num_samples=3, sampling_params=params).result()
    assert len(first.sequences) == 3
    for seq in first.sequences:
        assert 1 <= len(seq.tokens) <= 6
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0.0 for lp in seq.logprobs)
        assert seq.stop_reason in ("stop", "length")
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]


def test_a_training_client_is_a_run_with_a_loadable_tokenizer(service, stack) -> None:
    trainer = service.create_lora_training_client(base_model="tiny-base", rank=4).result()
    run_id = trainer.model_id
    assert run_id.startswith("run_tk_")
    rows = httpx.get(f"{stack.url}/v1/models").json()["data"]
    assert run_id in [m["id"] for m in rows]
    tokenizer = trainer.get_tokenizer()
    assert tokenizer.encode("abc", add_special_tokens=False) == load_tokenizer(stack.model).encode(
        "abc", add_special_tokens=False
    )


def test_an_unsupported_loss_is_the_sdks_error_not_a_hang(service, tok) -> None:
    trainer = service.create_lora_training_client(base_model="tiny-base", rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="'cispo' is not supported by plexrl"):
        trainer.forward_backward([_sft_datum(tok, "ab", "ba")], "cispo").result(timeout=60)


def test_a_rank_the_registry_refuses_is_its_reason_at_once(service) -> None:
    """A rank above this registry's limit (32). The registry's refusal (a
    RunConfigInvalid, never a row of the run list) reaches the client as the error, instead of
    a 60 s wait for a run that never comes ending in 'free a slot'."""
    with pytest.raises(tinker.RequestFailedError, match="rank: 64 is above this registry's limit"):
        service.create_lora_training_client(base_model="tiny-base", rank=64).result(timeout=50)


def _create_model(stack, session: str, rank: int) -> dict:
    """``create_model`` over plain HTTP (the SDK numbers its models itself), and its result."""
    body = {"session_id": session, "model_seq_id": 0, "base_model": "tiny-base"}
    made = httpx.post(
        f"{stack.url}/api/v1/create_model", json=body | {"lora_config": {"rank": rank}}
    )
    assert made.status_code == 200, made.text
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got = httpx.post(
            f"{stack.url}/api/v1/retrieve_future",
            json={"request_id": made.json()["request_id"]},
            timeout=60,
        ).json()
        if got.get("type") != "try_again":
            return got
    raise AssertionError(f"create_model of rank {rank} never finished")


def test_a_model_id_taken_with_another_rank_is_refused_at_once(stack) -> None:
    """The same session and model_seq_id again with another rank name the same run, which the
    registry holds with the first config: the client learns so at once. It used to get the
    existing run of the other rank back as if it were the one it asked for."""
    session = f"taken-{uuid.uuid4().hex[:8]}"
    first = _create_model(stack, session, rank=4)
    assert first.get("type") == "create_model", first
    assert _create_model(stack, session, rank=4) == first  # a resent request finds its run
    other = _create_model(stack, session, rank=8)
    assert "already exists with a different config" in str(other), other
    evict_runs(stack, {first["model_id"]}, "taken")


def test_unknown_base_model_and_unsupported_routes(service, stack) -> None:
    with pytest.raises(tinker.BadRequestError, match="is not served here"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    missing = httpx.post(f"{stack.url}/api/v1/create_custom_loss", json={})
    assert missing.status_code == 404 and "not supported" in missing.json()["detail"]
    bad = httpx.post(
        f"{stack.url}/api/v1/forward_backward",
        content=b"\x0a\xff\xff",
        headers={"content-type": "application/x-protobuf"},
    )
    assert bad.status_code == 400 and "not a ForwardBackwardRequest" in bad.json()["detail"]


def test_supervised_steps_lower_the_loss_on_a_fixed_batch(service, tok) -> None:
    trainer = service.create_lora_training_client(base_model="tiny-base", rank=8).result()
    batch = [_sft_datum(tok, w, w[::-1]) for w in ("abc", "hello", "xyz", "plexrl")]
    adam = types.AdamParams(learning_rate=5e-3)
    losses = []
    for _ in range(6):
        fb = trainer.forward_backward(batch, "cross_entropy")
        opt = trainer.optim_step(adam)
        out = fb.result(timeout=120)
        opt.result(timeout=120)
        losses.append(out.metrics["loss:sum"])
        assert len(out.loss_fn_outputs) == len(batch)
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < 0.9 * losses[0], losses


def test_sampling_saved_weights_matches_the_trainers_forward(service, tok, stack) -> None:
    trainer = service.create_lora_training_client(base_model="tiny-base", rank=8).result()
    batch = [_sft_datum(tok, "abc", "cba")]
    for _ in range(2):
        trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=120)
    saved = trainer.save_weights_for_sampler("after-two").result(timeout=120)
    assert saved.path == f"tinker://{trainer.model_id}/sampler_weights/after-two@2"
    sampler = service.create_sampling_client(model_path=saved.path).result()
    prompt = [tok.bos_token_id, *tok.encode("abc", add_special_tokens=False)]
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=2)
    [seq] = (
        sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result(timeout=120).sequences
    )
    tokens = prompt + list(seq.tokens)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(
                data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]
            ),
        },
    )
    forward = trainer.forward([datum], "cross_entropy").result(timeout=120)
    trained = forward.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
    assert trained == pytest.approx(list(seq.logprobs), abs=1e-4)


@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state")
def test_save_and_load_state(service, tok) -> None:
    trainer = service.create_lora_training_client(base_model="tiny-base", rank=4).result()
    batch = [_sft_datum(tok, "ab", "ba")]
    trainer.forward_backward(batch, "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=120)
    saved = trainer.save_state("first").result(timeout=120)
    assert saved.path.startswith(f"tinker://{trainer.model_id}/weights/")
    at_save = trainer.forward(batch, "cross_entropy").result(timeout=120).metrics["loss:sum"]
    trainer.forward_backward(batch, "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=120)
    moved = trainer.forward(batch, "cross_entropy").result(timeout=120).metrics["loss:sum"]
    assert moved != pytest.approx(at_save, abs=1e-6)
    trainer.load_state(saved.path).result(timeout=120)
    back = trainer.forward(batch, "cross_entropy").result(timeout=120).metrics["loss:sum"]
    assert back == pytest.approx(at_save, abs=1e-5)


def _steps(trainer, batch, n: int) -> list[tinker.ForwardBackwardOutput]:
    outs = []
    for _ in range(n):
        fb = trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result(timeout=120)
        outs.append(fb.result(timeout=120))
    return outs


@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state")
def test_two_clients_share_micro_batches_and_match_each_alone(service, tok) -> None:
    batch_a = [_sft_datum(tok, "abc", "cba"), _sft_datum(tok, "hello", "olleh")]
    batch_b = [_sft_datum(tok, "xyz", "zyx")]
    a = service.create_lora_training_client(base_model="tiny-base", rank=4).result()
    b = service.create_lora_training_client(base_model="tiny-base", rank=4).result()
    starts = [c.save_state("start").result(timeout=120).path for c in (a, b)]
    alone_a, alone_b = _steps(a, batch_a, 3), _steps(b, batch_b, 3)
    for client, path in zip((a, b), starts, strict=True):  # back to the start, Adam state too
        client.load_state_with_optimizer(path).result(timeout=120)

    def together() -> tuple[tinker.ForwardBackwardOutput, tinker.ForwardBackwardOutput]:
        fa = a.forward_backward(batch_a, "cross_entropy")
        fb = b.forward_backward(batch_b, "cross_entropy")
        oa = a.optim_step(types.AdamParams(learning_rate=5e-3))
        ob = b.optim_step(types.AdamParams(learning_rate=5e-3))
        outs = fa.result(timeout=120), fb.result(timeout=120)
        oa.result(timeout=120)
        ob.result(timeout=120)
        return outs

    rounds = [together() for _ in range(3)]
    for alone, now in ((alone_a, [r[0] for r in rounds]), (alone_b, [r[1] for r in rounds])):
        for x, y in zip(alone, now, strict=True):
            assert y.metrics["loss:sum"] == pytest.approx(x.metrics["loss:sum"], abs=1e-5)
            for dx, dy in zip(x.loss_fn_outputs, y.loss_fn_outputs, strict=True):
                assert dy["logprobs"].tolist() == pytest.approx(dx["logprobs"].tolist(), abs=1e-5)
    # Whether two calls meet in one pass depends on when the trainer takes its queue: the
    # calls of a round arrive together, so within a few rounds some pass holds both runs.
    while max(r[0].metrics["runs_in_pass:max"] for r in rounds) < 2.0 and len(rounds) < 12:
        rounds.append(together())
    shared = [r[0].metrics["runs_in_pass:max"] for r in rounds]
    assert max(shared) >= 2.0, shared


def test_openai_serves_a_tinker_trained_run_with_the_trainers_logprobs(service, tok, stack) -> None:
    import openai

    trainer = service.create_lora_training_client(base_model="tiny-base", rank=4).result()
    _steps(trainer, [_sft_datum(tok, "ab", "ba")], 2)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = [tok.bos_token_id, *tok.encode("ab", add_special_tokens=False)]
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=9)
    assert (
        sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result(timeout=120).sequences
    )

    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    made = client.completions.create(
        model=f"{trainer.model_id}@2",
        prompt="ab",
        max_tokens=5,
        temperature=1.0,
        logprobs=0,
        seed=1,
    )
    lp = made.choices[0].logprobs
    ids = [tok.convert_tokens_to_ids(t) for t in lp.tokens]
    tokens = prompt + ids
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(
                data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]
            ),
        },
    )
    forward = trainer.forward([datum], "cross_entropy").result(timeout=120)
    trained = forward.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
    assert lp.token_logprobs == pytest.approx(trained, abs=1e-4)
    # a third step, not published: its version is not served, and the answer says so at once
    _steps(trainer, [_sft_datum(tok, "ab", "ba")], 1)
    with pytest.raises(
        openai.NotFoundError, match=r"published are version 2 \(it has reached step 3\)"
    ):
        client.completions.create(model=f"{trainer.model_id}@3", prompt="ab", max_tokens=2)
