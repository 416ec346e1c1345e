"""Load a service's settings from defaults, a TOML file, ``PLEXRL_*`` variables and flags."""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from schemas.config import format_validation_error

S = TypeVar("S", bound=BaseModel)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class SettingsError(ValueError):
    """Settings that cannot be used; the message names the source and every problem."""


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags every service shares: ``--config`` and ``--nats-url``."""
    parser.add_argument(
        "--config", type=Path, default=None, help="TOML file with this service's settings"
    )
    parser.add_argument(
        "--nats-url",
        default=None,
        help=f"NATS server (env PLEXRL_NATS_URL, default {DEFAULT_NATS_URL})",
    )


def nats_url(args: argparse.Namespace | None = None) -> str:
    flag = getattr(args, "nats_url", None) if args is not None else None
    return flag or os.environ.get("PLEXRL_NATS_URL") or DEFAULT_NATS_URL


def _env_values(model: type[BaseModel], environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in model.model_fields:
        key = f"PLEXRL_{name.upper()}"
        if key in environ:
            values[name] = environ[key]
    return values


def load_settings(
    model: type[S],
    config_file: Path | str | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> S:
    """Build ``model`` from the TOML file, ``PLEXRL_<FIELD>`` variables and ``overrides``.

    ``overrides`` are flag values; ``None`` means "not given" and is skipped.
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
    data.update(_env_values(model, os.environ if environ is None else environ))
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        where = f" (from {config_file}, PLEXRL_* variables and flags)" if config_file else ""
        raise SettingsError(
            f"invalid {model.__name__} settings{where}: {format_validation_error(exc)}"
        ) from None
