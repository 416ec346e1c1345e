"""A sweep: one base run config, expanded over a grid and/or a list of variants into many runs.

In the ``plexrl up`` config (or the file given to ``plexrl sweep``)::

    [sweep]
    name = "lr"                       # optional; default: the base environment's name
    "optim.lr" = [1e-3, 2e-3, 4e-3]   # every other key is a dotted orch.toml key -> values
    seed = [0, 1]                     # the grid is the cartesian product: 6 runs
    variants = [{"loss.kl_coef" = 0.1}, {"loss.kl_coef" = 0.0, "model.lora.rank" = 4}]

    [sweep.early_stop]                # optional: successive halving, see services/up/halving.py
    after_steps = 10
    keep = 0.5

With both a grid and variants, every variant is applied on top of every grid point. Each run's
config is validated with :func:`schemas.config.orch_config_from_dict`; its id names the sweep
and the values that vary (``run_reverse-lr2e-3-s1``), shortened with a digest past the 64
characters a run id may hold. Two runs with the same config are an error, so are two ids the
same: nothing starts.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.config import ConfigError, OrchConfig
from schemas.run_id import validate_run_id

MAX_ID_BODY = 64
"""Characters after ``run_`` (schemas/run_id.py)."""

SWEEP_NAME_PATTERN = r"^[A-Za-z0-9_]{1,32}$"
"""No ``-``: a sweep's runs are ``run_<name>`` or ``run_<name>-...``, so one sweep's name is never
a prefix of another's runs (what ``plexrl runs --sweep`` relies on)."""

_SHORT_KEYS = {
    "optim.lr": "lr",
    "seed": "s",
    "model.lora.rank": "r",
    "model.lora.alpha": "a",
    "loss.kl_coef": "kl",
    "max_async_level": "async",
    "batch_size": "bs",
    "group_size": "g",
    "sampling.temperature": "t",
    "env": "",
}
_RESERVED = ("name", "variants", "early_stop")


class EarlyStop(BaseModel):
    """Successive halving: at step ``after_steps`` keep the best ``keep`` of the runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    after_steps: int = Field(ge=1, le=10_000_000, description="the step at which runs are judged")
    keep: float = Field(0.5, gt=0, lt=1, description="fraction of the runs judged that go on")
    window: int = Field(
        5,
        ge=1,
        le=10_000,
        description="a run's score: its mean reward over its last this many steps",
    )


class SweepSpec(BaseModel):
    """The ``[sweep]`` table: every key but ``name``, ``variants`` and ``early_stop`` is a grid
    axis, a dotted orch.toml key mapped to the list of its values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, pattern=SWEEP_NAME_PATTERN, description="prefix of the run ids")
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    variants: list[dict[str, Any]] = Field(default_factory=list)
    early_stop: EarlyStop | None = None

    @model_validator(mode="before")
    @classmethod
    def _axes_into_grid(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "grid" in data:
            return data
        axes = {k: v for k, v in data.items() if k not in _RESERVED}
        return {k: v for k, v in data.items() if k in _RESERVED} | {"grid": axes}

    @field_validator("grid")
    @classmethod
    def _lists_of_values(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in grid.items():
            if not values:
                raise ValueError(f"sweep axis {key!r} has no values")
        return grid

    @model_validator(mode="after")
    def _something_to_sweep(self) -> SweepSpec:
        if not self.grid and not self.variants:
            raise ValueError(
                'a [sweep] table needs at least one axis (e.g. "optim.lr" = [1e-3, 2e-3]) '
                "or a variants list"
            )
        return self


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: its id, validated config and the values that set it apart."""

    run_id: str
    config: OrchConfig
    values: dict[str, Any] = field(default_factory=dict)


def set_dotted(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of ``data`` with ``key`` ("optim.lr") set to ``value``, tables made as needed."""
    head, _, rest = key.partition(".")
    out = dict(data)
    if not rest:
        out[head] = value
        return out
    inner = out.get(head)
    out[head] = set_dotted(inner if isinstance(inner, dict) else {}, rest, value)
    return out


def expand(spec: SweepSpec, base: dict[str, Any], default_name: str) -> list[SweepRun]:
    """Every run of the sweep, in grid order.

    ``base`` is a run's config dict before validation; each run sets its dotted keys on it.
    Raises :class:`ConfigError` naming the sweep key and value of a run whose config is
    invalid, or the runs that would be identical.
    """
    keys = list(spec.grid)
    points = [
        dict(zip(keys, combo, strict=True)) for combo in itertools.product(*spec.grid.values())
    ]
    overrides = [p | v for p in points for v in spec.variants] if spec.variants else points
    name = spec.name or sweep_name(default_name)
    configs: list[OrchConfig] = []
    by_digest: dict[str, dict[str, Any]] = {}
    for values in overrides:
        data = base
        for key, value in values.items():
            data = set_dotted(data, key, value)
        config = _validated(data, values)
        digest = config.digest()
        if digest in by_digest:
            raise ConfigError(
                f"sweep: {_show(values)} and {_show(by_digest[digest])} give the same run config; "
                "remove one (a sweep never trains the same config twice)"
            )
        by_digest[digest] = values
        configs.append(config)
    # what sets the runs apart, read from the configs (a key some variants leave out has the
    # base value there)
    keys = list(dict.fromkeys(k for o in overrides for k in o))
    table = [{k: get_dotted(c.to_dict(), k) for k in keys} for c in configs]
    varied = [k for k in keys if len(configs) == 1 or len({repr(t[k]) for t in table}) > 1]
    shown = [{k: row[k] for k in varied} for row in table]
    ids = [sweep_run_id(name, v, c.digest()) for v, c in zip(shown, configs, strict=True)]
    # values that differ past the digits an id shows: those ids end with a digest instead
    ids = [
        i if ids.count(i) == 1 else "run_" + shorten(i[4:], c.digest(), force=True)
        for i, c in zip(ids, configs, strict=True)
    ]
    runs = [SweepRun(*r) for r in zip(ids, configs, shown, strict=True)]
    refuse_duplicate_ids(r.run_id for r in runs)
    rule = spec.early_stop
    too_short = [
        r.run_id for r in runs if rule is not None and r.config.max_steps <= rule.after_steps
    ]
    if rule is not None and too_short:
        raise ConfigError(
            f"sweep: early_stop.after_steps = {rule.after_steps} is not before the last step of "
            f"{', '.join(too_short)}; make it smaller than max_steps (the steps setting)"
        )
    return runs


def sweep_name(env: str) -> str:
    """The default name of a sweep of ``env``: its run-id characters, ``-`` made ``_``."""
    return id_token(env).replace("-", "_")[:32] or "sweep"


def _validated(data: dict[str, Any], values: dict[str, Any]) -> OrchConfig:
    from pydantic import ValidationError

    from schemas.config import format_validation_error

    try:
        return OrchConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            f"sweep: the run with {_show(values)} has an invalid config: "
            f"{format_validation_error(exc)}"
        ) from None


def get_dotted(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def _show(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} = {v!r}" for k, v in values.items()) or "the base config"


def id_token(value: Any) -> str:
    """``value`` as run-id characters: ``2e-3`` for 0.002, ``0p5`` for 0.5, ``a_b`` for "a.b"."""
    if isinstance(value, bool):
        text = "on" if value else "off"
    elif isinstance(value, float):
        text = _float_token(value)
    else:
        text = str(value)
    return re.sub(
        r"[^A-Za-z0-9_-]", "_", text.replace(".", "p") if isinstance(value, float) else text
    )


def _float_token(x: float) -> str:
    if x == 0 or not math.isfinite(x):
        return repr(x)
    if abs(x) < 1e-2 or abs(x) >= 1e5:
        mantissa, exponent = f"{x:.4e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return f"{x:g}"


def sweep_run_id(name: str, values: dict[str, Any], digest: str) -> str:
    """``run_<name>-<key><value>-...``; past 64 characters, cut and ended with a short digest."""
    parts = [name] + [
        _SHORT_KEYS.get(k, id_token(k.rsplit(".", 1)[-1])) + id_token(v) for k, v in values.items()
    ]
    return validate_run_id("run_" + shorten("-".join(parts), digest))


def shorten(body: str, digest: str, *, force: bool = False) -> str:
    """``body`` if it fits a run id (unless ``force``), else its head, ``-`` and 8 hex digits
    of ``digest``."""
    if len(body) <= MAX_ID_BODY and not force:
        return body
    tail = hashlib.sha256(digest.encode()).hexdigest()[:8]
    return f"{body[: MAX_ID_BODY - len(tail) - 1]}-{tail}"


def refuse_duplicate_ids(run_ids: Iterable[str]) -> None:
    """Raise :class:`ConfigError` naming every run id that appears more than once."""
    seen: set[str] = set()
    twice = sorted({r for r in run_ids if r in seen or seen.add(r)})  # type: ignore[func-returns-value]
    if twice:
        raise ConfigError(
            f"run ids appear more than once: {', '.join(twice)}; two runs would train as one. "
            "Give the sweep distinct values (or a shorter name) so every run has its own id"
        )


def distinct_ids(names: Iterable[str]) -> list[str]:
    """``run_<name>`` for each name; a name seen before gets ``_2``, ``_3`` ... (``envs`` lists)."""
    counts: dict[str, int] = {}
    out = []
    for name in names:
        counts[name] = counts.get(name, 0) + 1
        body = id_token(name)
        n = counts[name]
        out.append(
            validate_run_id("run_" + shorten(body if n == 1 else f"{body}_{n}", f"{name}/{n}"))
        )
    refuse_duplicate_ids(out)
    return out
