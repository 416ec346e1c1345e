"""The pure part of a step: prompt positions, seeds, requests, reply checks, scoring, batches."""

from __future__ import annotations

from typing import Any

import pytest

from schemas.events import Completion, GenerateResponse
from services.envs import load_environment
from services.model.tokenizer import build_char_tokenizer, character_vocab
from services.orchestrator import rollouts
from tests.envs.chat_model import build_chat_tokenizer

from .conftest import RUN, orch_config

VOCAB = character_vocab()


def test_prompt_positions_follow_the_step() -> None:
    assert [rollouts.prompt_index(0, 3, j) for j in range(3)] == [0, 1, 2]
    assert [rollouts.prompt_index(5, 3, j) for j in range(3)] == [15, 16, 17]
    with pytest.raises(ValueError):
        rollouts.prompt_index(1, 3, 3)


def test_request_seeds_are_stable_distinct_and_31_bit() -> None:
    seeds = {
        (s, n, i): rollouts.request_seed(s, n, i)
        for s in range(3)
        for n in range(20)
        for i in range(20)
    }
    assert len(set(seeds.values())) == len(seeds)  # 1200 triples, no collision
    assert all(0 <= v < 2**31 for v in seeds.values())
    # The same triple gives the same seed in every process: a fixed value, not hash().
    assert rollouts.request_seed(7, 3, 11) == rollouts.request_seed(7, 3, 11)
    # first 8 bytes of sha256("plexrl:7:3:11"), big-endian, low 31 bits (checked with sha256sum)
    assert rollouts.request_seed(7, 3, 11) == 527559641
    assert rollouts.request_seed(7, 3, 11) != rollouts.request_seed(7, 11, 3)


def test_plan_and_request_carry_the_run_settings(tokenizer: Any) -> None:
    config = orch_config(batch_size=3, group_size=5, sampling={"temperature": 0.7, "top_p": 1.0})
    env = load_environment("reverse", seed=7)
    planned = rollouts.plan_step(env, tokenizer, 4, 3)
    assert [p.index for p in planned] == [12, 13, 14]
    assert planned[1].prompt == env.prompt(13)
    request = rollouts.build_request(RUN, config, 4, planned[1], 3, 30.0)
    assert request.run_id == RUN
    assert request.prompts == [planned[1].token_ids]
    assert request.n == 5
    assert (request.temperature, request.top_p, request.max_tokens) == (0.7, 1.0, 16)
    assert request.min_policy_version == 3
    assert request.seed == rollouts.request_seed(7, 4, 13)
    assert request.timeout_s == 30.0
    assert request.request_id == f"{RUN}/step_4/prompt_13"


def test_a_chat_environments_prompts_are_planned_through_the_chat_template() -> None:
    pytest.importorskip("reasoning_gym")
    chat_tokenizer = build_chat_tokenizer()
    env = load_environment("reasoning_gym:basic_arithmetic", seed=7)
    planned = rollouts.plan_step(env, chat_tokenizer, 0, 2)
    for p in planned:
        assert chat_tokenizer.decode(p.token_ids) == (
            f"<|im_start|>user\n{p.prompt.text}<|im_end|>\n<|im_start|>assistant\n"
        )
    # the same environment for a model without a template: <bos> and the question
    text_ids = rollouts.plan_step(env, build_char_tokenizer(), 0, 2)[0].token_ids
    assert text_ids[0] == VOCAB["<bos>"] and len(text_ids) == len(planned[0].prompt.text) + 1


def _completion(ids: list[int], reason: str = "stop") -> Completion:
    return Completion(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason=reason)  # type: ignore[arg-type]


def _reply(request: Any, version: int, groups: list[list[Completion]]) -> GenerateResponse:
    return GenerateResponse(
        request_id=request.request_id, run_id=RUN, policy_version=version, completions=groups
    )


def test_check_response_accepts_a_matching_reply_and_names_every_defect(tokenizer: Any) -> None:
    config = orch_config(group_size=2)
    planned = rollouts.plan_step(load_environment("reverse", seed=7), tokenizer, 0, 2)
    request = rollouts.build_request(RUN, config, 2, planned[0], 1, 10.0)
    good = [_completion([5, 2]), _completion([6])]
    assert rollouts.check_response(request, _reply(request, 1, [good])) == good

    bad_cases = {
        "older than the required 1": _reply(request, 0, [good]),
        "2 prompts answered": _reply(request, 1, [good, good]),
        "1 completions, 2 asked": _reply(request, 1, [good[:1]]),
        "over max_tokens": _reply(request, 1, [[_completion([5] * 5), good[1]]]),
    }
    for message, reply in bad_cases.items():
        with pytest.raises(rollouts.BadResponse, match=message):
            rollouts.check_response(request, reply)
    torn = Completion(token_ids=[5, 6], logprobs=[-1.0], finish_reason="stop")
    with pytest.raises(rollouts.BadResponse, match="2 tokens but 1 logprobs"):
        rollouts.check_response(request, _reply(request, 1, [[torn, good[1]]]))


def test_score_decodes_without_special_tokens(tokenizer: Any) -> None:
    env = load_environment("reverse", seed=7)
    prompt = env.prompt(0)  # reverse: mjpst= -> tspjm
    right = [VOCAB[c] for c in prompt.target] + [VOCAB["<eos>"]]
    half = [VOCAB[c] for c in "tsxxx"]
    assert rollouts.score_group(
        env, tokenizer, prompt, [_completion(right), _completion(half)]
    ) == [
        1.0,
        0.2,  # two of five letters in place, not exact: half of 2/5
    ]


def test_assemble_batch_centres_each_group_and_takes_the_oldest_version(tokenizer: Any) -> None:
    planned = rollouts.plan_step(load_environment("reverse", seed=7), tokenizer, 1, 2)
    groups = [[_completion([5]), _completion([6, 7])], [_completion([8]), _completion([9])]]
    rewards = [[1.0, 0.5], [0.25, 0.25]]
    batch = rollouts.assemble_batch(RUN, 1, planned, groups, rewards, [3, 2], std_normalize=False)
    assert (batch.run_id, batch.step, batch.policy_version) == (RUN, 1, 2)
    assert [s.reward for s in batch.samples] == [1.0, 0.5, 0.25, 0.25]
    assert [s.advantage for s in batch.samples] == [0.25, -0.25, 0.0, 0.0]
    assert [s.prompt_ids for s in batch.samples] == [planned[0].token_ids] * 2 + [
        planned[1].token_ids
    ] * 2
    assert batch.samples[1].completion_ids == [6, 7]
    assert batch.samples[1].completion_logprobs == [-1.0, -1.0]

    normalised = rollouts.assemble_batch(
        RUN, 1, planned, groups, rewards, [3, 2], std_normalize=True
    )
    # (1 - 0.75) / (0.25 + 1e-6) for the first group; the flat group stays at exactly 0.
    assert normalised.samples[0].advantage == pytest.approx(1.0, abs=1e-5)
    assert normalised.samples[1].advantage == pytest.approx(-1.0, abs=1e-5)
    assert normalised.samples[2].advantage == 0.0
