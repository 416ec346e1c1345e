"""The stock ``tinker`` SDK's sampling beyond plain samples, against the shared stack: a sampler
of saved weights is a snapshot, prompts are scored as the trainer's forward scores them, the
most likely alternatives come back, and the sampling parameters mean what the SDK says."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import tinker
from test_tinker import _sft_datum
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


def _train(trainer, tok, steps: int) -> None:
    batch = [_sft_datum(tok, "abc", "cba"), _sft_datum(tok, "hey", "yeh")]
    for _ in range(steps):
        trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=3e-2)).result(timeout=120)


def _forward_logprobs(trainer, tokens: list[int]) -> list[float]:
    """The trainer's log-probability of tokens[1:] after the tokens before each."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(
                data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]
            )
        },
    )
    return (
        trainer.forward([datum], "cross_entropy")
        .result(timeout=120)
        .loss_fn_outputs[0]["logprobs"]
        .tolist()
    )


def test_a_saved_sampler_samples_its_version_after_three_more_steps(service, tok, stack) -> None:
    import openai

    trainer = service.create_lora_training_client(base_model="tiny-base", rank=8).result()
    _train(trainer, tok, 2)
    saved = trainer.save_weights_for_sampler("snap").result(timeout=120)
    assert saved.path.endswith("/sampler_weights/snap@2")
    sampler = service.create_sampling_client(model_path=saved.path).result()
    prompt = types.ModelInput.from_ints(
        [tok.bos_token_id, *tok.encode("abc", add_special_tokens=False)]
    )
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    before = sampler.sample(prompt, 2, params).result(timeout=120).sequences
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    pinned = dict(model=f"{trainer.model_id}@2", prompt="abc", max_tokens=6, seed=3, logprobs=0)
    openai_before = client.completions.create(**pinned)

    _train(trainer, tok, 3)  # versions 3..5, and 5 is published: inference moves on
    later = trainer.save_weights_for_sampler("later").result(timeout=120)
    assert later.path.endswith("@5")
    newer = service.create_sampling_client(model_path=later.path).result()
    moved = newer.sample(prompt, 2, params).result(timeout=120).sequences
    assert [s.tokens for s in moved] != [s.tokens for s in before]

    after = sampler.sample(prompt, 2, params).result(timeout=120).sequences
    assert [s.tokens for s in after] == [s.tokens for s in before]
    assert [s.logprobs for s in after] == [s.logprobs for s in before]
    openai_after = client.completions.create(**pinned)
    assert openai_after.choices[0].text == openai_before.choices[0].text
    assert (
        openai_after.choices[0].logprobs.token_logprobs
        == openai_before.choices[0].logprobs.token_logprobs
    )
    with pytest.raises(openai.NotFoundError, match="published are version 5"):
        client.completions.create(model=f"{trainer.model_id}@9", prompt="abc", max_tokens=2)


def test_prompt_logprobs_alternatives_and_sampling_parameters(service, tok) -> None:
    trainer = service.create_lora_training_client(base_model="tiny-base", rank=8).result()
    _train(trainer, tok, 1)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    ids = [tok.bos_token_id, *tok.encode("hello", add_special_tokens=False)]
    prompt = types.ModelInput.from_ints(ids)
    # compute_logprobs equals the trainer's forward of the same tokens (float32, 1e-4)
    scored = sampler.compute_logprobs(prompt).result(timeout=120)
    assert scored[0] is None and len(scored) == len(ids)
    assert scored[1:] == pytest.approx(_forward_logprobs(trainer, ids), abs=1e-4)
    # the alternatives: sorted, three per position, the prompt token's own logprob among them
    # when it is one of the three
    out = sampler.sample(
        prompt,
        1,
        types.SamplingParams(max_tokens=4, temperature=1.0, seed=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=2,
    ).result(timeout=120)
    assert out.prompt_logprobs[1:] == pytest.approx(scored[1:], abs=1e-6)
    assert out.topk_prompt_logprobs[0] is None or out.topk_prompt_logprobs[0] == []
    for t in range(1, len(ids)):
        top = out.topk_prompt_logprobs[t]
        assert len(top) == 3 and [lp for _, lp in top] == sorted(
            (lp for _, lp in top), reverse=True
        )
        if ids[t] in dict(top):
            assert dict(top)[ids[t]] == pytest.approx(scored[t], abs=1e-5)
    [seq] = out.sequences
    assert len(seq.topk_logprobs) == len(seq.tokens)
    assert all(len(row) == 2 for row in seq.topk_logprobs)
    # top_k=1 at temperature 1 samples the argmax: what temperature 0 samples
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result(
        timeout=120
    )
    top1 = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, top_k=1, seed=9)).result(
        timeout=120
    )
    assert top1.sequences[0].tokens == greedy.sequences[0].tokens
    # stop=[] runs through end-of-sequence; max_tokens unset runs to the gateway's limit (64,
    # less than the context left)
    [free] = (
        sampler.sample(prompt, 1, types.SamplingParams(stop=[], seed=2))
        .result(timeout=120)
        .sequences
    )
    assert len(free.tokens) == 64 and free.stop_reason == "length"
    # stop strings and token ids still end a sequence, and keep it
    eos = tok.eos_token_id
    [stopped] = (
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=64, stop=[eos], seed=2))
        .result(timeout=120)
        .sequences
    )
    assert eos not in stopped.tokens[:-1]


def test_a_base_sampler_takes_no_run_and_scores_like_a_fresh_adapter(service, tok, stack) -> None:
    before = {m["id"] for m in httpx.get(f"{stack.url}/v1/models").json()["data"]}
    base = service.create_sampling_client(base_model="tiny-base").result()
    fresh = service.create_lora_training_client(base_model="tiny-base", rank=4).result()
    ids = [tok.bos_token_id, *tok.encode("plexrl", add_special_tokens=False)]
    scored = base.compute_logprobs(types.ModelInput.from_ints(ids)).result(timeout=120)
    # a new adapter (B = 0) is the base model: its forward is the reference
    assert scored[1:] == pytest.approx(_forward_logprobs(fresh, ids), abs=1e-4)
    listed = {m["id"] for m in httpx.get(f"{stack.url}/v1/models").json()["data"]}
    assert listed - before == {fresh.model_id}  # the base sampler holds no run


def test_cancel_future_cancels_a_sample_and_nothing_else(stack) -> None:
    made = httpx.post(
        f"{stack.url}/api/v1/asample",
        json={
            "base_model": "tiny-base",
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 5, 6]}]},
            "num_samples": 64,
            "sampling_params": {"max_tokens": 64, "stop": []},
        },
    )
    future = made.json()["request_id"]
    assert (
        httpx.post(f"{stack.url}/api/v1/cancel_future", json={"request_id": future}).status_code
        == 200
    )
    deadline = time.monotonic() + 60
    while True:
        got = httpx.post(
            f"{stack.url}/api/v1/retrieve_future", json={"request_id": future}, timeout=60
        ).json()
        if got.get("type") != "try_again" or time.monotonic() > deadline:
            break
    assert got == {"error": "cancelled by the client (cancel_future)", "category": "user"}
    unknown = httpx.post(f"{stack.url}/api/v1/cancel_future", json={"request_id": "sample-nope"})
    assert unknown.status_code == 404
