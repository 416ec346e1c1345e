"""The reference pages of the documentation, written from the code that defines them.

``mkdocs build`` calls these through ``docs/hooks.py``, so the pages cannot drift from the code:

- :func:`configuration_page`: every service setting (its ``PLEXRL_*`` variable, flag, default
  and description, from the pydantic settings models), the run config ``orch.toml`` and the
  tenants file, field by field;
- :func:`events_page`: every subject with its stream, producers and consumers (the channel
  table of ``schemas/subjects.py``), and every event with its fields (``schemas/events.py``);
- :func:`cli_page`: every ``plexrl`` command with its arguments (the argparse parsers).

A setting or a run-config field without a description is a :class:`MissingDescription`, which
fails the build: every knob a user can turn says what it does.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import json
from collections.abc import Iterable
from typing import Any

import msgspec
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

SETTINGS: tuple[tuple[str, str, str], ...] = (
    ("Every command", "services.config:ProcessSettings", "read by every `plexrl` command"),
    ("Registry", "services.registry.settings:RegistrySettings", "`plexrl registry`"),
    ("Trainer", "services.trainer.settings:TrainerSettings", "`plexrl trainer`"),
    ("Inference", "services.inference.settings:InferenceSettings", "`plexrl inference`"),
    (
        "Orchestrator",
        "services.orchestrator.settings:OrchestratorSettings",
        "`plexrl orchestrator`",
    ),
    ("Gateway", "services.gateway.settings:GatewaySettings", "`plexrl gateway`"),
    ("plexrl up", "services.up.settings:UpSettings", "`plexrl up`"),
)


class MissingDescription(ValueError):
    """A setting or config field that does not say what it does."""


def _load(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(field: Any) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
        if callable(value) or not isinstance(value, str | int | float | bool | list | dict):
            return "(computed)"
    else:
        value = field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "unset"
    if isinstance(value, str | int | float | bool | list | dict):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    text = text.replace("typing.", "").replace("pathlib.", "").replace("NoneType", "None")
    return f"`{text}`"


def settings_table(model: type[BaseModel], where: str) -> list[str]:
    from services.config import env_name

    lines = [
        "| setting | variable | flag | default | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, field in model.model_fields.items():
        if not field.description:
            raise MissingDescription(
                f"{model.__name__}.{name} ({where}) has no description: say what it does in "
                "its Field(description=...)"
            )
        flag = "--" + name.replace("_", "-")
        lines.append(
            f"| `{name}` | `{env_name(name)}` | `{flag}` | {_default(field)} | "
            f"{_cell(field.description)} |"
        )
    return lines


def _config_rows(model: type[BaseModel], prefix: str = "") -> Iterable[str]:
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        inner = field.annotation
        if inspect.isclass(inner) and issubclass(inner, BaseModel):
            yield from _config_rows(inner, f"{key}.")
            continue
        if not field.description:
            raise MissingDescription(
                f"field {key} of {model.__name__} has no description: say what it does in its "
                "Field(description=...)"
            )
        yield f"| `{key}` | {_type(inner)} | {_default(field)} | {_cell(field.description)} |"


def configuration_page() -> str:
    from schemas.config import OrchConfig
    from services.config.tenants import TenantQuota

    out = [
        "# Configuration reference",
        "",
        "Generated from the code at every build of this site (`docs/reference.py`): the",
        "settings models of the services, the run config and the tenants file.",
        "",
        "Service settings are read, lowest precedence first, from their defaults, the TOML file",
        "given with `--config`, `PLEXRL_<SETTING>` environment variables and command-line flags.",
        "",
    ]
    for title, target, where in SETTINGS:
        model = _load(target)
        out += [f"## {title}", "", f"`{model.__name__}`, {where}.", ""]
        out += settings_table(model, where)
        out.append("")
    out += [
        "## The run config (`orch.toml`)",
        "",
        "Each run's `control/orch.toml`, validated by `OrchConfig` (`schemas/config.py`). Unknown",
        "keys are rejected; nested tables are written `[model.lora]` and so on.",
        "",
        "| key | type | default | description |",
        "| --- | --- | --- | --- |",
        *_config_rows(OrchConfig),
        "",
        "## The tenants file (`tenants.toml`)",
        "",
        "`[tenants.<name>]` tables of `TenantQuota` (`services/config/tenants.py`); "
        "`plexrl tenants add` writes them.",
        "",
        "| key | type | default | description |",
        "| --- | --- | --- | --- |",
        *_config_rows(TenantQuota),
        "",
    ]
    return "\n".join(out)


def _fields(cls: type[msgspec.Struct]) -> list[str]:
    info = msgspec.inspect.type_info(cls)
    lines = ["| field | type | default |", "| --- | --- | --- |"]
    for field in getattr(info, "fields", ()):
        if field.name in ("type",):
            continue
        if field.required:
            default = "required"
        elif field.default is not msgspec.NODEFAULT:
            default = f"`{json.dumps(msgspec.to_builtins(field.default))}`"
        else:
            default = "(empty)"
        lines.append(f"| `{field.name}` | `{type(field.type).__name__}` | {default} |")
    return lines


def events_page() -> str:
    from schemas.events import ALL_EVENTS, event_tag
    from schemas.subjects import CHANNELS, KV_BUCKETS, OBJECT_STORES

    out = [
        "# Events and subjects reference",
        "",
        "Generated from `schemas/subjects.py` and `schemas/events.py` at every build. Subjects",
        "are as the services' account sees them; a tenant's account sees its own slice",
        "([Tenants and security](../tenants.md)). The JSON Schemas of every event are in",
        "`schemas/json/`, the AsyncAPI document in `schemas/asyncapi.yaml`.",
        "",
        "## Subjects",
        "",
        "| subject | stream | messages | producers | consumers | what |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for ch in CHANNELS:
        messages = ", ".join(f"`{event_tag(m)}`" for m in ch.messages)
        if ch.reply:
            messages += " (reply: " + ", ".join(f"`{event_tag(m)}`" for m in ch.reply) + ")"
        out.append(
            f"| `{ch.address}` | {ch.stream or 'core NATS'} | {messages} | {_cell(ch.producers)} "
            f"| {_cell(ch.consumers)} | {_cell(ch.summary)} |"
        )
    out += ["", "## Buckets and stores", "", "| name | holds |", "| --- | --- |"]
    out += [f"| `{k}` (KV) | {_cell(v)} |" for k, v in KV_BUCKETS.items()]
    out += [f"| `{k}` (object store) | {_cell(v)} |" for k, v in OBJECT_STORES.items()]
    out += ["", "## Events", ""]
    for cls in ALL_EVENTS:
        doc = inspect.cleandoc(cls.__doc__ or "")
        out += [f"### `{event_tag(cls)}`", "", f"`{cls.__name__}`. {doc}", "", *_fields(cls), ""]
    return "\n".join(out)


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        name = ", ".join(action.option_strings) or action.metavar or action.dest
        help_text = (action.help or "").replace("%(default)s", str(action.default))
        rows.append(f"| `{name}` | {_cell(help_text)} |")
    if not rows:
        return []
    return ["| argument | what |", "| --- | --- |", *rows]


def cli_page() -> str:
    from services.cli import build_parser

    parser = build_parser()
    out = [
        "# Command line reference",
        "",
        "Generated from the `plexrl` command's argparse parsers at every build; `plexrl",
        "COMMAND --help` prints the same. A service's flags are generated from its settings",
        "model ([Configuration](configuration.md)).",
        "",
    ]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        out += [f"## `plexrl {name}`", "", _cell(command.description or ""), ""]
        out += [f"```text\n{command.format_usage().strip()}\n```", ""]
        out += _arguments(command)
        nested = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        for group in nested:
            for inner_name, inner in group.choices.items():
                out += [f"### `plexrl {name} {inner_name}`", "", _cell(inner.description or ""), ""]
                out += _arguments(inner)
                out.append("")
        out.append("")
    return "\n".join(out)


PAGES = {
    "reference/configuration.md": configuration_page,
    "reference/events.md": events_page,
    "reference/cli.md": cli_page,
}
