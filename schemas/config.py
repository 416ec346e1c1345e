"""The run config, ``control/orch.toml``, as a typed pydantic model.

Unknown keys are rejected (a typo fails loudly) and every number has bounds. Load a file with
:func:`load_orch_config` or a string with :func:`parse_orch_config`; both raise
:class:`ConfigError`, whose message lists every problem as ``path: what is wrong``.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

DEFAULT_MAX_LORA_RANK = 16
"""The largest LoRA rank the registry admits, the trainer's slots hold and inference serves,
unless a deployment sets ``max_lora_rank``: one default, so a run the registry admits always
fits the trainer's slots."""

DEFAULT_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""The linear modules that carry LoRA adapters unless a deployment sets ``target_modules``:
every attention and MLP projection of a Llama-style model, the same in trainer and inference."""


class ConfigError(ValueError):
    """A config that cannot be used, with every problem listed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraConfig(_Strict):
    """The run's LoRA adapter."""

    rank: int = Field(8, ge=1, le=256, description="LoRA rank r")
    alpha: float = Field(
        16.0, gt=0, le=4096, description="LoRA alpha; the update is scaled by alpha / rank"
    )


class ModelConfig(_Strict):
    lora: LoraConfig = Field(default_factory=LoraConfig)


class OptimConfig(_Strict):
    """AdamW and its schedule, per run."""

    lr: float = Field(1e-3, gt=0, le=1.0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, le=1e-2, description="AdamW's epsilon")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="per-run gradient clipping")
    warmup_steps: int = Field(0, ge=0, le=1_000_000, description="linear warm-up from 0 to lr")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="decay after warm-up, to min_lr_ratio * lr at max_steps"
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1.0, description="where the decay ends, as a fraction of lr"
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


class LossConfig(_Strict):
    """The importance-sampled policy loss (see services/trainer/loss.py)."""

    mode: Literal["clip", "mask", "cispo", "gspo", "dppo", "tis"] = Field(
        "clip",
        description="the policy term (services/trainer/policy_losses.py): 'clip' PPO's clipped "
        "ratio; 'mask' drop tokens whose ratio leaves the bounds; 'cispo' clip the importance "
        "weight, never the gradient; 'gspo' one clipped ratio per sequence; 'dppo' drop tokens "
        "whose probability moved more than tv_delta; 'tis' truncated importance weight",
    )
    normalize: Literal["tokens", "constant"] = Field(
        "tokens",
        description="divide a run's summed token losses by its number of completion tokens in "
        "the step ('tokens'), or by samples * sampling.max_tokens ('constant', Dr. GRPO: long "
        "completions are not weighted down)",
    )
    tv_delta: float = Field(
        0.2,
        gt=0,
        le=1.0,
        description="'dppo': the probability a token may gain (A > 0) or lose (A < 0) before it "
        "is dropped",
    )
    tis_cap: float = Field(
        2.0, ge=1.0, le=1000.0, description="'tis': the importance weight's upper bound"
    )
    clip_low: float = Field(0.2, ge=0, le=1.0, description="lower bound is 1 - clip_low")
    clip_high: float = Field(0.2, ge=0, le=100.0, description="upper bound is 1 + clip_high")
    kl_coef: float = Field(
        0.0, ge=0, le=100.0, description="weight of the KL term to the base model"
    )
    kl_estimator: Literal["k1", "k3"] = Field(
        "k3",
        description="'k3': kl_coef * k3 is a loss term (low variance; GRPO's); 'k1': kl_coef * k1 "
        "is a reward penalty subtracted from each token's advantage (its gradient is that of "
        "KL(pi || base)); see services/trainer/loss.py",
    )
    dual_clip: float = Field(
        3.0,
        ge=0,
        le=1000.0,
        description="dual-clip PPO for tokens with a negative advantage A: their loss is bounded "
        "by dual_clip * |A| (mode 'clip'); must be > 1, or 0 to turn it off",
        # The JSON Schema says what the validator below enforces: 0, or more than 1.
        json_schema_extra={"not": {"exclusiveMinimum": 0, "maximum": 1}},
    )

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip_above_one(cls, v: float) -> float:
        if 0 < v <= 1:
            raise ValueError(
                f"dual_clip = {v} would cap the loss of every token with A < 0 at or below its "
                "value at ratio 1, so negative advantages would teach nothing; use a value > 1 "
                "(3 is usual) or 0 to turn it off"
            )
        return v


class SamplingConfig(_Strict):
    """How inference samples the run's training completions."""

    temperature: float = Field(
        1.0,
        gt=0,
        le=10.0,
        description="softmax temperature; > 0 for training (the trainer scores tokens at it)",
    )
    top_p: float = Field(
        1.0,
        ge=1.0,
        le=1.0,
        description="nucleus mass; only 1 is admitted, as the trainer scores tokens under the "
        "full distribution",
    )
    max_tokens: int = Field(16, ge=1, le=32768, description="completion length limit")

    # Before the bounds, so that these two settings get the reason, not just the bound.
    @field_validator("temperature", mode="before")
    @classmethod
    def _not_greedy(cls, v: Any) -> Any:
        if _is_number(v) and v == 0:
            raise ValueError(
                "temperature 0 is greedy decoding: the samples of a group are identical, so "
                "every advantage is zero and the run cannot learn; use temperature > 0 for "
                "training (evaluation may use 0)"
            )
        return v

    @field_validator("top_p", mode="before")
    @classmethod
    def _full_distribution(cls, v: Any) -> Any:
        if _is_number(v) and v < 1:
            raise ValueError(
                f"top_p = {v} samples from a renormalised nucleus, but the trainer scores tokens "
                "under the full distribution, so the importance ratio would not be 1 even on "
                "the first step; use top_p = 1 for training"
            )
        return v


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class AdvantageConfig(_Strict):
    std_normalize: bool = Field(False, description="divide group-centred rewards by the group std")
    dynamic_sampling: bool = Field(
        False,
        description="drop groups whose rewards are all equal and replace them with new prompts "
        "until the batch is full (DAPO); after a bounded number of rounds the step is published "
        "with the groups it has",
    )


class EvalConfig(_Strict):
    """Held-out evaluation: the run's policy and the base model on prompts training never sees.

    Every ``interval`` steps and after the last one, the orchestrator scores the current policy
    greedily (temperature 0) and ``samples`` times at the run's temperature (pass@k) on the
    first ``num_prompts`` held-out prompts; once, before the first step, it scores the base
    model greedily and at each of ``base_temperatures``, and the best of those is ``base_best``.
    """

    interval: int = Field(
        10, ge=0, le=1_000_000, description="evaluate every this many steps; 0 turns it off"
    )
    num_prompts: int = Field(64, ge=1, le=4096, description="held-out prompts per evaluation")
    pass_k: int = Field(
        4, ge=1, le=1024, description="k of pass@k, sampled at the run's temperature"
    )
    samples: int = Field(
        4, ge=1, le=1024, description="samples per prompt for pass@k (n >= k of the estimator)"
    )
    base_temperatures: tuple[float, ...] = Field(
        (0.1, 0.5, 1.0),
        max_length=16,
        description="temperatures at which the base is scored, besides greedy (temperature 0)",
    )

    @field_validator("base_temperatures")
    @classmethod
    def _temperatures_in_range(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if not all(0.0 < t <= 10.0 for t in v):
            raise ValueError("each base temperature must be in (0, 10]; greedy is always included")
        return v

    @model_validator(mode="after")
    def _enough_samples(self) -> EvalConfig:
        if self.samples < self.pass_k:
            raise ValueError(f"samples ({self.samples}) must be >= pass_k ({self.pass_k})")
        return self


class CkptConfig(_Strict):
    interval: int = Field(50, ge=1, le=1_000_000, description="checkpoint every this many steps")
    keep: int = Field(2, ge=1, le=1000, description="complete checkpoints kept per run")


class OrchConfig(_Strict):
    """A run's config: ``{output_dir}/<run_id>/control/orch.toml``."""

    env: str = Field(
        "reverse",
        min_length=1,
        max_length=256,
        description="built-in env or 'package.module:factory'",
    )
    env_args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments for the environment"
    )
    driver: Literal["rollouts", "commands"] = Field(
        "rollouts",
        description="what trains the run: 'rollouts', RolloutBatch events from an orchestrator "
        "(env, batch_size, sampling... apply), or 'commands', training commands "
        "(forward_backward, optim_step... on plexrl.train.*; the Tinker gateway) whose "
        "requests carry the data and the optimizer settings",
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**31 - 1,
        description="seeds the prompt order, the adapter's initialisation and the sampling",
    )
    max_steps: int = Field(200, ge=1, le=10_000_000, description="optimizer steps of the run")
    batch_size: int = Field(8, ge=1, le=4096, description="prompts per step")
    group_size: int = Field(8, ge=1, le=1024, description="completions per prompt")
    max_async_level: int = Field(
        1, ge=0, le=64, description="how many steps generation may run ahead"
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    labels: dict[
        Annotated[str, StringConstraints(min_length=1, max_length=128)],
        Annotated[str, StringConstraints(max_length=1024)],
    ] = Field(
        default_factory=dict,
        max_length=64,
        description="free-form text labels of the run, listed with it (the run list's rows "
        "carry them): the Tinker gateway records a run's session, base model and the user's "
        "metadata here; nothing in plexrl trains differently for them",
    )

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON-compatible data (what RunSubmitted.config carries)."""
        return self.model_dump(mode="json")

    def digest(self) -> str:
        """A stable ``sha256:`` digest of the normalised config (defaults filled in)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see schemas/config.py for the accepted keys)"
        lines.append(f"{loc}: {msg}")
    return "; ".join(lines)


def orch_config_from_dict(data: dict[str, Any]) -> OrchConfig:
    """Validate ``data`` as a run config; raise :class:`ConfigError` listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError(f"a run config is a table/object, got {type(data).__name__}")
    try:
        return OrchConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def parse_orch_config(text: str) -> OrchConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}") from None
    return orch_config_from_dict(data)


def load_orch_config(path: str | Path) -> OrchConfig:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p} is not UTF-8 text") from None
    try:
        return parse_orch_config(text)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None


def dump_toml(data: dict[str, Any]) -> str:
    """Write a config dict as TOML (scalars and lists first, then tables, as TOML requires)."""
    out: list[str] = []
    _dump_table(data, [], out)
    return "\n".join(out).lstrip("\n") + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return (
            "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
        )
    raise ConfigError(f"cannot write {type(v).__name__} to TOML")


def _dump_table(data: dict[str, Any], path: list[str], out: list[str]) -> None:
    # free-form tables are written inline: their keys are quoted (a label key may hold a dot)
    inline = ("env_args", "labels") if not path else ()
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict) or not v or k in inline}
    tables = {k: v for k, v in data.items() if k not in scalars}
    if path and scalars:
        out.append("")
        out.append("[" + ".".join(path) + "]")
    for k, v in scalars.items():
        if isinstance(v, dict) and not v:
            out.append(f"{k} = {{}}")
        else:
            out.append(f"{k} = {_toml_value(v)}")
    for k, v in tables.items():
        _dump_table(v, [*path, k], out)
