"""The official ``openai`` client's parameters beyond the basics, against the shared stack: the
most likely alternatives, prompts scored with ``echo``, ``models.retrieve``, the usage chunk of
a stream, and a 400 naming every parameter plexrl does not implement (never ignored)."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from test_openai import _logprobs_of

from services.model.loader import load_model, load_tokenizer

pytestmark = pytest.mark.timeout(300)
BASE = "tiny-base"


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=90)


def test_top_logprobs_are_the_models_most_likely_tokens(client, stack) -> None:
    tok = load_tokenizer(stack.model)
    made = client.completions.create(
        model=BASE, prompt="abc", max_tokens=4, temperature=1.0, logprobs=3, seed=3
    )
    lp = made.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) >= 1
    prompt = [tok.bos_token_id, *tok.encode("abc", add_special_tokens=False)]
    completion = [tok.convert_tokens_to_ids(t) for t in lp.tokens]
    model, _ = load_model(stack.model)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    rows = torch.log_softmax(logits, -1)[len(prompt) - 1 :]
    for k, top in enumerate(lp.top_logprobs):
        values, ids = rows[k].topk(3)
        assert list(top) == [tok.convert_ids_to_tokens(i) for i in ids.tolist()]
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
    chat = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        seed=1,
    )
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs = true"):
        client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "hi"}], top_logprobs=2
        )


def test_echo_scores_the_prompt_as_the_model_does(client, stack) -> None:
    tok = load_tokenizer(stack.model)
    scored = client.completions.create(
        model=BASE, prompt="hello", max_tokens=0, echo=True, logprobs=0
    )
    choice = scored.choices[0]
    prompt = [tok.bos_token_id, *tok.encode("hello", add_special_tokens=False)]
    assert choice.text == "hello" and choice.logprobs.token_logprobs[0] is None
    expected = _logprobs_of(stack.model, prompt[:1], prompt[1:])
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    both = client.completions.create(
        model=BASE, prompt="hello", max_tokens=3, echo=True, logprobs=0, seed=2
    )
    assert both.choices[0].text.startswith("hello")
    assert len(both.choices[0].logprobs.tokens) == len(prompt) + both.usage.completion_tokens


def test_models_retrieve_and_the_usage_chunk_of_a_stream(client) -> None:
    assert client.models.retrieve(BASE).id == BASE
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("run_nobody_here")
    chunks = list(
        client.completions.create(
            model=BASE,
            prompt="ab",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 3
    text = "".join(c.choices[0].text for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens >= 1 and isinstance(text, str)
    chat = list(
        client.chat.completions.create(
            model=BASE,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chat[-1].usage is not None and chat[-1].usage.total_tokens > 0


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("best_of", 2),
        ("logit_bias", {"5": 10}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 0.5),
        ("suffix", "zz"),
        ("user", "someone"),
    ],
)
def test_completion_parameters_plexrl_does_not_implement_are_refused(client, param, value) -> None:
    with pytest.raises(openai.BadRequestError, match=f"parameter '{param}' is not supported"):
        client.completions.create(model=BASE, prompt="ab", max_tokens=2, **{param: value})


def test_chat_parameters_plexrl_does_not_implement_are_refused(client) -> None:
    hi = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for param, value in (
        ("tools", [tool]),
        ("response_format", {"type": "json_object"}),
        ("presence_penalty", 1.0),
    ):
        with pytest.raises(openai.BadRequestError, match=f"parameter '{param}' is not supported"):
            client.chat.completions.create(model=BASE, messages=hi, max_tokens=2, **{param: value})
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[0\] is of type"):
        client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": image}], max_tokens=2
        )
    # neutral values ask for nothing and are accepted
    done = client.chat.completions.create(
        model=BASE, messages=hi, max_tokens=2, presence_penalty=0, response_format={"type": "text"}
    )
    assert done.choices[0].message.content is not None
    assert math.isfinite(done.usage.total_tokens)
