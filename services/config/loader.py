"""Load a service's settings from defaults, a TOML file, ``PLEXRL_*`` variables and flags."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, get_origin

from pydantic import BaseModel, ValidationError

from schemas.config import format_validation_error

S = TypeVar("S", bound=BaseModel)


class SettingsError(ValueError):
    """Settings that cannot be used; the message names the source and every problem."""


def env_name(field: str) -> str:
    """The environment variable of a settings field: ``max_runs`` -> ``PLEXRL_MAX_RUNS``."""
    return f"PLEXRL_{field.upper()}"


def _env_values(model: type[BaseModel], environ: Mapping[str, str]) -> dict[str, Any]:
    """The fields set by ``PLEXRL_<FIELD>``; a list is given comma- or space-separated."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        raw = environ.get(env_name(name))
        if raw is not None:
            is_list = get_origin(field.annotation) is list
            values[name] = [v for v in re.split(r"[,\s]+", raw) if v] if is_list else raw
    return values


def load_settings(
    model: type[S],
    config_file: Path | str | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> S:
    """Build ``model`` from the TOML file, ``PLEXRL_<FIELD>`` variables and ``overrides``.

    Precedence, lowest first: field defaults, the file, the variables, ``overrides`` (flag
    values; ``None`` means "not given" and is skipped).
    """
    data: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        try:
            data.update(tomllib.loads(path.read_text(encoding="utf-8")))
        except OSError as exc:
            raise SettingsError(f"cannot read settings file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{path}: invalid TOML: {exc}") from None
    from_env = _env_values(model, os.environ if environ is None else environ)
    data.update(from_env)
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    data.update(flags)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        where = f" (from {config_file}, PLEXRL_* variables and flags)" if config_file else ""
        blamed = sorted(
            {
                env_name(str(err["loc"][0]))
                for err in exc.errors()
                if err["loc"] and err["loc"][0] in from_env and err["loc"][0] not in flags
            }
        )
        set_by = f" (set by {', '.join(blamed)})" if blamed else ""
        raise SettingsError(
            f"invalid {model.__name__} settings{where}: {format_validation_error(exc)}{set_by}"
        ) from None
