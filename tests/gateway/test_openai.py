"""The OpenAI-compatible API, driven by the official ``openai`` client against a real gateway
(registry, trainer, inference and gateway processes on a real nats-server, the tiny model)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch

from schemas.events import RunSubmitted
from schemas.subjects import runs_subject
from services.bus import Bus
from services.model.loader import load_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=90)


@pytest.fixture(scope="module")
def run_id(stack) -> str:
    """A run of the tests' own, at policy version 0 (LoRA B = 0: it behaves as the base)."""
    run = "run_openai"

    async def submit() -> None:
        bus = await Bus.connect(stack.nats_url, "test")
        try:
            event = RunSubmitted(run_id=run, config={"env": "reverse", "max_steps": 5})
            await bus.publish("plexrl.runs.submit", event, msg_id=f"{run}/submit/test")
        finally:
            await bus.close()

    asyncio.run(submit())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ids = [m["id"] for m in httpx.get(f"{stack.url}/v1/models").json()["data"]]
        if run in ids:
            return run
        time.sleep(0.2)
    raise AssertionError(f"{run} never became active:\n{stack.all_logs()}")


def _logprobs_of(model_dir, prompt: list[int], completion: list[int]) -> list[float]:
    """The base model's log-probability of each completion token (temperature 1)."""
    model, _ = load_model(model_dir)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [float(logp[start + k, t]) for k, t in enumerate(completion)]


def test_models_lists_the_base_and_active_runs(client, run_id) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids[0] == "tiny-base"
    assert run_id in ids
    assert "run_gateway_base" not in ids


def test_completion_of_a_run_with_logprobs_of_the_model(client, run_id, stack) -> None:
    made = client.completions.create(
        model=run_id, prompt="abc", max_tokens=6, temperature=1.0, logprobs=0, seed=7
    )
    assert made.object == "text_completion" and made.model == run_id
    [choice] = made.choices
    assert choice.finish_reason in ("stop", "length")
    assert made.usage is not None and made.usage.prompt_tokens == 4  # <bos> a b c
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    n = made.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == n >= 1
    # the character tokenizer: one token per character, so the tokens spell the completion
    from services.model.loader import load_tokenizer

    tok = load_tokenizer(stack.model)
    ids = [tok.convert_tokens_to_ids(t) for t in lp.tokens]
    expected = _logprobs_of(
        stack.model, [tok.bos_token_id, *tok.encode("abc", add_special_tokens=False)], ids
    )
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    text = tok.decode(ids, skip_special_tokens=True)
    assert choice.text == text


def test_same_seed_same_completion_and_n_choices(client, run_id) -> None:
    args = dict(model=run_id, prompt=["xy", "hello"], max_tokens=5, temperature=1.0, seed=3, n=2)
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_streamed_completion_is_the_same_text(client, run_id) -> None:
    args = dict(model=run_id, prompt="stream me", max_tokens=8, temperature=1.0, seed=11)
    whole = client.completions.create(**args).choices[0]
    chunks = list(client.completions.create(**args, stream=True))
    assert len(chunks) >= 1
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_completion_and_stream(client, run_id) -> None:
    messages = [{"role": "user", "content": "reverse abc"}]
    args = dict(model=run_id, messages=messages, max_tokens=6, temperature=1.0, seed=5)
    chat = client.chat.completions.create(**args, logprobs=True)
    [choice] = chat.choices
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == chat.usage.completion_tokens
    assert all(t.logprob <= 0.0 for t in choice.logprobs.content)
    stream = list(client.chat.completions.create(**args, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == choice.message.content
    assert stream[-1].choices[0].finish_reason == choice.finish_reason


def test_stop_string_ends_the_completion(client, run_id) -> None:
    base = client.completions.create(model=run_id, prompt="q", max_tokens=12, temperature=0.0)
    text = base.choices[0].text
    if len(text) < 3:
        pytest.skip("the greedy completion is too short to cut")
    stop = text[2]
    cut = client.completions.create(
        model=run_id, prompt="q", max_tokens=12, temperature=0.0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_base_model_by_name(client) -> None:
    made = client.completions.create(model="tiny-base", prompt="hi", max_tokens=3, temperature=0.0)
    assert made.model == "tiny-base" and len(made.choices) == 1


def test_unknown_model_and_missing_version_are_404(client, run_id) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="run_nobody", prompt="x", max_tokens=2)
    assert "run_nobody" in err.value.body["message"]
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(
            model=f"{run_id}@12", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    assert f"the newest weights {run_id} has published are version 0" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)


def test_bad_input_gets_clear_errors_and_the_gateway_stays_up(client, run_id, stack) -> None:
    url = f"{stack.url}/v1/completions"
    bad = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400
    assert "not valid JSON" in bad.json()["error"]["message"]
    missing = httpx.post(url, json={"prompt": "x"})
    assert missing.status_code == 400 and "model" in missing.json()["error"]["message"]
    huge = httpx.post(url, json={"model": run_id, "prompt": "x" * 300_000})
    assert huge.status_code == 413 and "limit" in huge.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens 1000 is over"):
        client.completions.create(model=run_id, prompt="x", max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=run_id, prompt=[10**6], max_tokens=2)
    nowhere = httpx.get(f"{stack.url}/v1/embeddings")
    assert nowhere.status_code == 404 and "not an endpoint" in nowhere.json()["error"]["message"]
    # still serving
    ok = client.completions.create(model=run_id, prompt="x", max_tokens=2)
    assert len(ok.choices) == 1
    assert stack.procs["gateway"].poll() is None


def test_a_run_of_another_tenant_is_not_served(client, stack) -> None:
    run = "run_team_a_only"

    async def submit() -> None:
        bus = await Bus.connect(stack.nats_url, "test")
        try:
            event = RunSubmitted(run_id=run, config={"env": "reverse", "max_steps": 5})
            await bus.publish(runs_subject("submit", "team-a"), event, msg_id=f"{run}/test")
        finally:
            await bus.close()

    asyncio.run(submit())
    deadline = time.monotonic() + 60
    while True:
        rows = asyncio.run(_rows(stack.nats_url))
        if any(r.run_id == run and r.status == "active" for r in rows):
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.2)
    assert next(r for r in rows if r.run_id == run).tenant == "team-a"
    assert run not in [m.id for m in client.models.list()]
    with pytest.raises(openai.NotFoundError, match="'run_team_a_only' does not exist") as refused:
        client.completions.create(model=run, prompt="x", max_tokens=2)
    assert "team-a" not in str(refused.value)  # nor whose it is


async def _rows(url: str) -> list:
    from services.runs.table import list_runs

    bus = await Bus.connect(url, "test")
    try:
        return await list_runs(bus)
    finally:
        await bus.close()
