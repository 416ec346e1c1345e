"""Held-out evaluation of a run: its policy and the base model on prompts training never sees.

Sampled training reward at the run's temperature mostly measures how greedy the policy has
become, not what it learned: the base model at a low temperature often does as well. So a run
is measured on the environment's held-out split (:mod:`services.envs.base`: disjoint from every
training prompt by construction), on the same ``eval.num_prompts`` prompts each time:

- **base**, once before the first step, at policy version 0 (LoRA B = 0, exactly the base
  model): the mean reward greedily (temperature 0) and at each of ``eval.base_temperatures``;
  ``base_best`` is the best of those, ``base_best_temperature`` where it was reached (0 for
  greedy). Stored in ``{run_dir}/heldout_base.json``, so a resumed run keeps it;
- **policy**, every ``eval.interval`` steps and after the last one, at the newest version the
  trainer announced: ``heldout_greedy`` (mean greedy reward), ``heldout_sampled`` (mean reward of
  ``eval.samples`` samples per prompt at the run's temperature) and ``heldout_pass_at_k``.

``gain = heldout_greedy - base_best`` is then the gain over the best the base does without
training. pass@k counts a sample as solved when its reward is 1 (the exact answer) and uses the
unbiased estimator of Chen et al. (2021) over ``n = eval.samples`` samples of which ``c`` are
solved, averaged over prompts::

    pass@k = 1 - C(n - c, k) / C(n, k)

Evaluation requests go to inference like a step's, with request ids ``<run_id>/eval_<tag>/...``;
nothing of them reaches the rollout stream or the run's sample counts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.config import OrchConfig
from schemas.events import GenerateRequest
from services.envs import Environment, prompt_token_ids, score_completion
from services.orchestrator import rollouts
from services.orchestrator.client import GenerateClient
from services.orchestrator.state import run_dir
from services.orchestrator.step import ScoringError

log = logging.getLogger(__name__)

PROMPTS_PER_REQUEST = 8
SOLVED = 1.0 - 1e-9
"""A sample is solved when its reward reaches 1 (up to float rounding)."""
BASE_NAME = "heldout_base.json"


class EvalUnavailable(RuntimeError):
    """The evaluation cannot measure what it was asked to (e.g. the base is no longer served)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` are solved."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(rewards_PN: Sequence[Sequence[float]], k: int) -> float:
    """pass@k averaged over prompts, one row of ``n`` sample rewards per prompt."""
    if not rewards_PN:
        raise ValueError("no prompts to estimate pass@k on")
    return sum(pass_at_k(len(r), sum(x >= SOLVED for x in r), k) for r in rewards_PN) / len(
        rewards_PN
    )


@dataclass(frozen=True)
class BaseEval:
    """The base model on the held-out prompts: mean reward by temperature (0 is greedy)."""

    by_temperature: dict[float, float]

    @property
    def best_temperature(self) -> float:
        """The temperature of the best mean reward; ties go to the lowest temperature."""
        return min(self.by_temperature, key=lambda t: (-self.by_temperature[t], t))

    @property
    def best(self) -> float:
        return self.by_temperature[self.best_temperature]

    def fields(self) -> dict[str, Any]:
        return {
            "base_greedy": round(self.by_temperature[0.0], 6)
            if 0.0 in self.by_temperature
            else None,
            "base_best": round(self.best, 6),
            "base_best_temperature": self.best_temperature,
        }


@dataclass(frozen=True)
class PolicyEval:
    """The policy on the held-out prompts at one version."""

    policy_version: int
    greedy: float
    sampled: float
    pass_at_k: float
    pass_k: int

    def fields(self) -> dict[str, Any]:
        return {
            "heldout_greedy": round(self.greedy, 6),
            "heldout_sampled": round(self.sampled, 6),
            "heldout_pass_at_k": round(self.pass_at_k, 6),
            "pass_k": self.pass_k,
            "eval_policy_version": self.policy_version,
        }


def eval_due(step: int, config: OrchConfig) -> bool:
    """Whether the policy is evaluated after ``step``: every ``interval`` steps and the last."""
    interval = config.eval.interval
    if interval == 0:
        return False
    return (step + 1) % interval == 0 or step == config.max_steps - 1


def base_key(config: OrchConfig) -> str:
    """What a base evaluation depends on besides the model: the prompts and how they are
    sampled. A stored evaluation with another key (an earlier life of the run id with another
    config) is measured again."""
    ev, sampling = config.eval, config.sampling
    parts = [config.env, config.env_args, config.seed, ev.num_prompts, list(ev.base_temperatures)]
    parts += [sampling.max_tokens, sampling.top_p]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def read_base(path: Path, key: str = "") -> BaseEval | None:
    """A stored base evaluation, or None if there is none, it was made with another ``key`` or
    it is unreadable (then the base is evaluated again, which is only a matter of time)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key", "") != key:
            return None
        return BaseEval({float(t): float(r) for t, r in data["by_temperature"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_base(path: Path, base: BaseEval, key: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    data = {"key": key, "by_temperature": {str(t): r for t, r in base.by_temperature.items()}}
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class HeldOutEvaluator:
    """Scores one run's policy and base on the first ``eval.num_prompts`` held-out prompts."""

    def __init__(
        self,
        run_id: str,
        config: OrchConfig,
        *,
        env: Environment,
        tokenizer: Any,
        client: GenerateClient,
        output_dir: Path,
        max_concurrent_requests: int = 64,
    ) -> None:
        self.run_id = run_id
        self.config = config
        self.env = env
        self.tokenizer = tokenizer
        self.client = client
        self.base_path = run_dir(output_dir, run_id) / BASE_NAME
        self.prompts = env.heldout_prompts(config.eval.num_prompts)
        self.token_ids = [prompt_token_ids(tokenizer, p) for p in self.prompts]
        self._in_flight = asyncio.Semaphore(max_concurrent_requests)
        self.version_wait_s = min(max(client.timeout / 2, 0.1), 3600.0)

    async def base(self) -> BaseEval:
        """The base model's evaluation: stored, or measured now at policy version 0."""
        stored = read_base(self.base_path, base_key(self.config))
        if stored is not None:
            return stored
        by_temperature = {}
        for temperature in (0.0, *self.config.eval.base_temperatures):
            rewards, version = await self.score(f"base_t{temperature:g}", temperature, 1, 0)
            if version != 0:
                raise EvalUnavailable(
                    f"inference answered with policy version {version}, not the base (0)"
                )
            by_temperature[temperature] = _mean([r for row in rewards for r in row])
        base = BaseEval(by_temperature)
        write_base(self.base_path, base, base_key(self.config))
        return base

    async def policy(self, step: int, min_version: int) -> PolicyEval:
        """The policy at version ``>= min_version``, greedy and sampled."""
        ev = self.config.eval
        greedy, v_greedy = await self.score(f"step_{step}_greedy", 0.0, 1, min_version)
        temperature = self.config.sampling.temperature
        sampled, v_sampled = await self.score(
            f"step_{step}_sampled", temperature, ev.samples, min_version
        )
        return PolicyEval(
            policy_version=min(v_greedy, v_sampled),
            greedy=_mean([r for row in greedy for r in row]),
            sampled=_mean([r for row in sampled for r in row]),
            pass_at_k=mean_pass_at_k(sampled, ev.pass_k),
            pass_k=ev.pass_k,
        )

    async def score(
        self, tag: str, temperature: float, n: int, min_version: int
    ) -> tuple[list[list[float]], int]:
        """Rewards of ``n`` samples of each held-out prompt, and the oldest version used."""
        requests = [
            self._request(tag, chunk, temperature, n, min_version)
            for chunk in range(0, len(self.token_ids), PROMPTS_PER_REQUEST)
        ]
        replies = await asyncio.gather(*(self._generate(r) for r in requests))
        groups = [g for completions, _ in replies for g in completions]
        rewards = await asyncio.to_thread(self._score, tag, groups)
        return rewards, min(v for _, v in replies)

    def _score(self, tag: str, groups: list[list[Any]]) -> list[list[float]]:
        # The boundary around the environment's code, as for a step (see step.py).
        try:
            rewards = [
                [score_completion(self.env, self.tokenizer, p, c.token_ids) for c in group]
                for p, group in zip(self.prompts, groups, strict=True)
            ]
            if not all(math.isfinite(r) for row in rewards for r in row):
                raise ValueError("a reward is NaN or inf")
        except Exception as exc:
            raise ScoringError(
                f"environment {self.config.env!r} failed to score evaluation {tag}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return rewards

    def _request(
        self, tag: str, start: int, temperature: float, n: int, min_version: int
    ) -> GenerateRequest:
        sampling = self.config.sampling
        digest = hashlib.sha256(f"plexrl-eval:{self.config.seed}:{tag}:{start}".encode()).digest()
        return GenerateRequest(
            request_id=f"{self.run_id}/eval_{tag}/prompts_{start}",
            run_id=self.run_id,
            prompts=self.token_ids[start : start + PROMPTS_PER_REQUEST],
            n=n,
            max_tokens=sampling.max_tokens,
            temperature=temperature,
            top_p=sampling.top_p if temperature > 0 else 1.0,
            min_policy_version=min_version,
            seed=int.from_bytes(digest[:8], "big") & ((1 << rollouts.SEED_BITS) - 1),
            timeout_s=self.version_wait_s,
        )

    async def _generate(self, request: GenerateRequest) -> tuple[list[Any], int]:
        async with self._in_flight:
            response = await self.client.generate(request)
        return rollouts.check_completions(request, response), response.policy_version


def fields_of(policy: PolicyEval, base: BaseEval | None) -> dict[str, Any]:
    """The metrics.jsonl keys of an eval step."""
    return policy.fields() | (base.fields() if base is not None else {})


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
