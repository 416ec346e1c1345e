"""One step's rollouts, from prompts to a RolloutBatch: the pure part of the orchestrator.

Step ``n`` of a run with ``B = batch_size`` prompts and ``G = group_size`` completions each:

1. prompt ``j`` of the step is the environment's training prompt ``n * B + j`` (never a
   held-out prompt, see :mod:`services.envs.base`): the dataset position is a function of the
   step alone, so a resumed orchestrator draws exactly the prompts a step would have had,
   whichever source (its checkpoint, the trainer, the stream) told it the step;
2. each prompt becomes one GenerateRequest with ``n = G``, ``min_policy_version`` the step's
   off-policy bound and a seed from ``(config.seed, n, prompt index)``, so a step generated
   twice against the same policy yields the same tokens;
3. each completion is decoded without special tokens and scored by the environment (the prompt
   convention of :mod:`services.envs.prompts`): the reward ``r_ij`` of completion ``j`` of
   prompt ``i``, in [0, 1];
4. group-relative advantages (GRPO, see :mod:`services.orchestrator.advantages`)::

       A_ij = r_ij - mean_j r_ij                       advantage.std_normalize = false
       A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + eps)   advantage.std_normalize = true

   with the population std and ``eps = 1e-6``; a group whose rewards are all equal gets 0;
5. ``RolloutBatch.policy_version`` is the oldest version that generated any sample, the
   minimum over the step's responses.

Dynamic sampling (``advantage.dynamic_sampling``, DAPO, Yu et al. 2025): a group whose rewards
are all equal has advantage 0 and teaches nothing, so it is dropped and replaced by refill
prompts (:func:`plan_refill`) until ``B`` groups have spread; :func:`fill_groups` decides
which groups a batch keeps. Unlike DAPO, which keeps sampling until the batch is full, refills
stop after ``MAX_REFILL_ROUNDS`` rounds and the batch is topped up with dropped groups
(advantage 0), so a step always carries ``B`` groups and a run whose prompts are all solved (or
all hopeless) keeps moving.

Nothing here touches the bus: the run loop sends the requests and publishes the batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from schemas.config import OrchConfig
from schemas.events import Completion, GenerateRequest, GenerateResponse, RolloutBatch, Sample
from services.envs import Environment, Prompt, prompt_token_ids, score_completion
from services.orchestrator.advantages import batch_advantages

SEED_BITS = 31
"""Request seeds fit a signed 32-bit integer, so a client or engine in any language takes them."""

MAX_REFILL_ROUNDS = 4
"""Rounds of refill prompts dynamic sampling generates for one step before it gives up."""


class BadResponse(ValueError):
    """A GenerateResponse that does not answer its request (shape, lengths or policy version)."""


def prompt_index(step: int, batch_size: int, j: int) -> int:
    """The environment index of prompt ``j`` of ``step``."""
    if step < 0 or not 0 <= j < batch_size:
        raise ValueError(f"no prompt {j} in step {step} with batch_size {batch_size}")
    return step * batch_size + j


def request_seed(run_seed: int, step: int, index: int) -> int:
    """The sampling seed of the request for prompt ``index`` of ``step``.

    A hash rather than arithmetic on the three numbers, so that neighbouring steps and prompts
    get unrelated seeds, and stable across processes and Python versions (``hash()`` is not).
    """
    digest = hashlib.sha256(f"plexrl:{run_seed}:{step}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << SEED_BITS) - 1)


@dataclass(frozen=True)
class PlannedPrompt:
    """One prompt of a step: its environment index, the task and its token ids."""

    index: int
    prompt: Prompt
    token_ids: list[int]


def plan_step(env: Environment, tokenizer: Any, step: int, batch_size: int) -> list[PlannedPrompt]:
    """The ``batch_size`` prompts of ``step``, in order."""
    planned = []
    for j in range(batch_size):
        index = prompt_index(step, batch_size, j)
        prompt = env.train_prompt(index)
        planned.append(PlannedPrompt(index, prompt, prompt_token_ids(tokenizer, prompt)))
    return planned


def refill_index(step: int, refill_round: int, j: int) -> int:
    """The environment index of refill prompt ``j`` of ``refill_round`` (from 1) of ``step``.

    A hash into ``[2**40, 2**41)``, far above the positions of the regular steps, so a refill
    prompt is not a prompt a later step draws anyway, and stable across processes.
    """
    if step < 0 or refill_round < 1 or j < 0:
        raise ValueError(f"no refill prompt {j} in round {refill_round} of step {step}")
    digest = hashlib.sha256(f"plexrl-refill:{step}:{refill_round}:{j}".encode()).digest()
    return (1 << 40) + (int.from_bytes(digest[:5], "big") & ((1 << 40) - 1))


def plan_refill(
    env: Environment, tokenizer: Any, step: int, refill_round: int, count: int
) -> list[PlannedPrompt]:
    """``count`` fresh training prompts that replace dropped groups of ``step``."""
    planned = []
    for j in range(count):
        index = refill_index(step, refill_round, j)
        prompt = env.train_prompt(index)
        planned.append(PlannedPrompt(index, prompt, prompt_token_ids(tokenizer, prompt)))
    return planned


def has_spread(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ, i.e. whether its advantages can be non-zero."""
    return max(rewards) != min(rewards) if rewards else False


@dataclass(frozen=True)
class ScoredGroup:
    """One prompt's completions, their rewards and the policy version that generated them."""

    planned: PlannedPrompt
    completions: list[Completion]
    rewards: list[float]
    policy_version: int


def fill_groups(
    kept: Sequence[ScoredGroup], candidates: Sequence[ScoredGroup], batch_size: int
) -> tuple[list[ScoredGroup], list[ScoredGroup]]:
    """``(kept, dropped)``: ``kept`` extended, in order, by the candidates with reward spread,
    up to ``batch_size`` groups; ``dropped`` the candidates without spread. Candidates with
    spread beyond ``batch_size`` are neither (they were not needed)."""
    out = list(kept)
    dropped = []
    for group in candidates:
        if not has_spread(group.rewards):
            dropped.append(group)
        elif len(out) < batch_size:
            out.append(group)
    return out, dropped


def top_up(
    kept: Sequence[ScoredGroup], dropped: Sequence[ScoredGroup], batch_size: int
) -> list[ScoredGroup]:
    """``kept`` filled up to ``batch_size`` with dropped groups, when the refills ran out."""
    return [*kept, *dropped[: max(0, batch_size - len(kept))]]


def build_request(
    run_id: str,
    config: OrchConfig,
    step: int,
    planned: PlannedPrompt,
    min_policy_version: int,
    timeout_s: float,
) -> GenerateRequest:
    """The GenerateRequest for one prompt: ``group_size`` completions of it."""
    sampling = config.sampling
    return GenerateRequest(
        request_id=f"{run_id}/step_{step}/prompt_{planned.index}",
        run_id=run_id,
        prompts=[planned.token_ids],
        n=config.group_size,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        min_policy_version=min_policy_version,
        seed=request_seed(config.seed, step, planned.index),
        timeout_s=timeout_s,
    )


def check_response(request: GenerateRequest, response: GenerateResponse) -> list[Completion]:
    """The completions of the request's single prompt; :class:`BadResponse` if the reply is off.

    The checks catch a replica that breaks the contract (DESIGN.md, "Off-policy bound" and
    "GenerateResponse") before its data reaches the trainer, where it would be much harder to
    trace back.
    """
    return check_completions(request, response)[0]


def check_completions(
    request: GenerateRequest, response: GenerateResponse
) -> list[list[Completion]]:
    """The completions of every prompt of the request, in order (see :func:`check_response`)."""
    where = f"reply to {request.request_id}"
    if response.error:
        raise BadResponse(f"{where}: {response.error}")
    if response.policy_version < request.min_policy_version:
        raise BadResponse(
            f"{where}: generated with policy version {response.policy_version}, older than the "
            f"required {request.min_policy_version}"
        )
    if len(response.completions) != len(request.prompts):
        raise BadResponse(
            f"{where}: {len(response.completions)} prompts answered, {len(request.prompts)} asked"
        )
    for group in response.completions:
        if len(group) != request.n:
            raise BadResponse(f"{where}: {len(group)} completions, {request.n} asked")
        for k, completion in enumerate(group):
            if len(completion.token_ids) != len(completion.logprobs):
                raise BadResponse(
                    f"{where}: completion {k} has {len(completion.token_ids)} tokens but "
                    f"{len(completion.logprobs)} logprobs"
                )
            if len(completion.token_ids) > request.max_tokens:
                raise BadResponse(
                    f"{where}: completion {k} has {len(completion.token_ids)} tokens, over "
                    f"max_tokens={request.max_tokens}"
                )
    return response.completions


def score_group(
    env: Environment, tokenizer: Any, prompt: Prompt, group: Sequence[Completion]
) -> list[float]:
    """Rewards of one prompt's completions, each decoded without special tokens."""
    return [score_completion(env, tokenizer, prompt, c.token_ids) for c in group]


def assemble_batch(
    run_id: str,
    step: int,
    planned: Sequence[PlannedPrompt],
    groups: Sequence[Sequence[Completion]],
    rewards_PG: Sequence[Sequence[float]],
    policy_versions: Sequence[int],
    std_normalize: bool,
) -> RolloutBatch:
    """The RolloutBatch of ``step``: samples prompt by prompt, completion by completion."""
    if not (len(planned) == len(groups) == len(rewards_PG) == len(policy_versions) > 0):
        raise ValueError("one group, one row of rewards and one policy version per prompt")
    advantages_PG = batch_advantages(rewards_PG, std_normalize=std_normalize).tolist()
    samples = [
        Sample(
            prompt_ids=p.token_ids,
            completion_ids=c.token_ids,
            completion_logprobs=c.logprobs,
            reward=r,
            advantage=a,
        )
        for p, group, rewards, advantages in zip(
            planned, groups, rewards_PG, advantages_PG, strict=True
        )
        for c, r, a in zip(group, rewards, advantages, strict=True)
    ]
    return RolloutBatch(
        run_id=run_id, step=step, policy_version=min(policy_versions), samples=samples
    )
