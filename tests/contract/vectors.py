"""The contract files the tests read: examples, committed schemas and their validators."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

import schemas
from schemas.collective import COLLECTIVE_MESSAGES, CollectiveMessage
from schemas.events import ALL_EVENTS, SCHEMA_VERSION, AnyEvent, Event, event_tag

SCHEMAS_DIR = Path(schemas.__file__).resolve().parent
JSON_DIR = SCHEMAS_DIR / "json"
EXAMPLES_DIR = SCHEMAS_DIR / "examples"
CURRENT_DIR = EXAMPLES_DIR / f"v{SCHEMA_VERSION}"
ORCH_EXAMPLES_DIR = EXAMPLES_DIR / "orch_config"
REPO_ROOT = SCHEMAS_DIR.parent

EVENTS: dict[str, type[Event]] = {
    event_tag(cls): cls for cls in (*ALL_EVENTS, *COLLECTIVE_MESSAGES)
}
TAGS = sorted(EVENTS)


def union_of(cls: type[Event]) -> Any:
    """The union a generic reader decodes ``cls`` with: AnyEvent, or for the collective
    membership messages (core NATS, outside the streams) CollectiveMessage."""
    return CollectiveMessage if cls in COLLECTIVE_MESSAGES else AnyEvent


@dataclass(frozen=True)
class Example:
    version: int
    tag: str
    path: Path

    @property
    def cls(self) -> type[Event]:
        return EVENTS[self.tag]

    @property
    def raw(self) -> bytes:
        return self.path.read_bytes()

    @property
    def data(self) -> Any:
        return json.loads(self.raw)

    def __str__(self) -> str:
        return f"v{self.version}/{self.tag}/{self.path.name}"


def version_dirs() -> list[tuple[int, Path]]:
    found = [
        (int(m.group(1)), p)
        for p in EXAMPLES_DIR.iterdir()
        if p.is_dir() and (m := re.fullmatch(r"v(\d+)", p.name))
    ]
    return sorted(found)


def examples(prefix: str, *, all_versions: bool) -> list[Example]:
    out = []
    for version, vdir in version_dirs():
        if not all_versions and version != SCHEMA_VERSION:
            continue
        for tag_dir in sorted(p for p in vdir.iterdir() if p.is_dir()):
            for path in sorted(tag_dir.glob(f"{prefix}_*.json")):
                out.append(Example(version, tag_dir.name, path))
    return out


def expected_errors(directory: Path) -> dict[str, list[str]]:
    data: dict[str, list[str]] = json.loads((directory / "expected_errors.json").read_text())
    return data


@functools.cache
def committed_schema(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((JSON_DIR / f"{name}.json").read_text())
    return schema


@functools.cache
def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator(committed_schema(name))
