"""Command-line flags generated from a settings model: one declaration per setting.

Field ``max_runs`` becomes ``--max-runs``, typed from its annotation (a ``Literal`` gives the
choices, a ``bool`` ``--x/--no-x``, a ``list`` takes several values or a comma-separated one and
may be repeated) with the field's description, default and variable in ``--help``. Fields whose
type is not a flag's (a table) are set in the ``--config`` file only. A flag that is not given
is absent from the parsed namespace, so it never hides the file or the environment.
"""

from __future__ import annotations

import argparse
import re
import types
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from services.config.loader import env_name, load_settings
from services.config.process import ProcessSettings, process_settings

S = TypeVar("S", bound=BaseModel)

_SCALARS = (int, float, str, Path)
_METAVARS = {int: "N", float: "X", str: "TEXT", Path: "PATH"}


class _ExtendSplit(argparse.Action):
    """A list flag: ``--x a b``, ``--x a,b`` and ``--x a --x b`` all give ``[a, b]``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        items = [i for v in values for i in re.split(r"[,\s]+", v) if i]
        setattr(namespace, self.dest, [*getattr(namespace, self.dest, []), *items])


def _flag_type(annotation: Any) -> tuple[str, Any] | None:
    """``("bool" | "list" | "choice" | "value", detail)`` for a field type, None if no flag."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return _flag_type(inner[0]) if len(inner) == 1 else None
    if annotation is bool:
        return "bool", None
    if origin is Literal:
        return "choice", get_args(annotation)
    if origin is list and get_args(annotation)[0] in _SCALARS:
        return "list", None
    if annotation in _SCALARS:
        return "value", annotation
    return None


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required; "
    value = field.get_default(call_default_factory=True)
    if field.default_factory is not None and not isinstance(value, list):
        return ""  # computed at start-up (a host name, say): the description says how
    if isinstance(value, bool):
        value = "true" if value else "false"
    elif isinstance(value, list):
        value = ",".join(map(str, value)) or "none"
    return "" if value is None else f"default {value}; "


def _help(name: str, field: FieldInfo, from_env: bool) -> str:
    where = f"{_default_text(field)}env {env_name(name)}" if from_env else _default_text(field)
    text = f"{field.description or name.replace('_', ' ')} ({where.removesuffix('; ')})"
    return text.replace("%", "%%").replace(" ()", "")


def add_settings_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    aliases: Mapping[str, Sequence[str]] | None = None,
    only: Collection[str] | None = None,
    from_env: bool = True,
) -> None:
    """One flag per field of ``model`` (or of ``only``), with ``aliases`` as other spellings.

    ``from_env=False`` leaves the ``PLEXRL_<FIELD>`` variable out of the help, for a command
    that does not read it.
    """
    for name, field in model.model_fields.items():
        flag = _flag_type(field.annotation)
        if flag is None or (only is not None and name not in only):
            continue
        kind, detail = flag
        names = [f"--{name.replace('_', '-')}", *(aliases or {}).get(name, ())]
        common: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        common["help"] = _help(name, field, from_env)
        if kind == "bool":
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
        elif kind == "list":
            parser.add_argument(*names, action=_ExtendSplit, nargs="+", metavar="ITEM", **common)
        elif kind == "choice":
            parser.add_argument(*names, choices=detail, type=type(detail[0]), **common)
        else:
            parser.add_argument(*names, type=detail, metavar=_METAVARS[detail], **common)


def add_common_args(parser: argparse.ArgumentParser, *, config: bool = True) -> None:
    """``--config FILE`` (a TOML file of the service's settings) and ``--nats-url``."""
    if config:
        parser.add_argument(
            "--config", type=Path, default=None, help="TOML file with this service's settings"
        )
    add_settings_flags(parser, ProcessSettings, only=("nats_url",))


def flag_values(model: type[BaseModel], args: argparse.Namespace) -> dict[str, Any]:
    """The flags given on the command line for fields of ``model``."""
    return {name: getattr(args, name) for name in model.model_fields if hasattr(args, name)}


def settings_from_args(
    model: type[S], args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> S:
    """``model`` from defaults, the ``--config`` file, ``PLEXRL_*`` variables and the flags."""
    return load_settings(model, getattr(args, "config", None), flag_values(model, args), environ)


def nats_url(args: argparse.Namespace) -> str:
    """``--nats-url``, else ``PLEXRL_NATS_URL``, else the local default."""
    return process_settings(**flag_values(ProcessSettings, args)).nats_url
