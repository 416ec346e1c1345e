"""The language-neutral contract, generated from the Python types.

- ``json/<tag>.json``: one JSON Schema (Draft 2020-12) per event, derived from
  ``msgspec.json.schema``. Each file stands alone (its ``$defs`` travel with it). The ``type``
  tag is a required ``const``; unknown properties are allowed because wire events tolerate them.
- ``json/orch_config.json``: the run config, from pydantic; unknown keys are forbidden.
- ``json/run_record.json``, ``json/progress.json``: the KV records (:mod:`schemas.records`), untagged,
  unknown properties allowed.
- ``asyncapi.yaml``: an AsyncAPI 3.0 document of every channel in :data:`schemas.subjects.CHANNELS`.

Output is byte-for-byte deterministic, so ``plexrl schemas check`` can compare the committed files
with freshly generated ones and CI can fail when someone changes a type without re-exporting.
"""

from __future__ import annotations

import difflib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from schemas.collective import COLLECTIVE_MESSAGES
from schemas.config import OrchConfig
from schemas.events import ALL_EVENTS, SCHEMA_VERSION, Event, event_tag
from schemas.records import ALL_RECORDS, RECORD_BUCKETS
from schemas.run_id import RUN_ID_PATTERN
from schemas.subjects import CHANNELS, KV_BUCKETS, OBJECT_STORES, STREAMS, Channel

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
ASYNCAPI_FILE = "asyncapi.yaml"
JSON_DIR = "json"
ORCH_CONFIG_FILE = "orch_config.json"

HEADERS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "NATS headers. plexrl publishers set all three; readers need none of them.",
    "properties": {
        "Nats-Msg-Id": {
            "type": "string",
            "description": (
                "Deduplication id: JetStream drops a second message with the same id inside the "
                "stream's duplicate window. A RolloutBatch uses <run_id>/step_<step>."
            ),
        },
        "traceparent": {
            "type": "string",
            "pattern": "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
            "description": "W3C trace context, so that one trace follows a batch through every service.",
        },
        "Content-Type": {
            "type": "string",
            "enum": ["application/json", "application/msgpack"],
            "default": "application/json",
            "description": (
                "application/msgpack when the payload is MessagePack; JSON (the canonical "
                "encoding) otherwise."
            ),
        },
    },
}

_PARAMETERS: dict[str, dict[str, Any]] = {
    "run_id": {
        "description": "The run id: 'run_' followed by 1-64 letters, digits, '_' or '-'.",
        "examples": ["run_abc123"],
    },
    "tenant": {
        "description": "A tenant: 1-64 letters, digits, '_' or '-', not starting with 'run_'. In "
        "an ingest subject it is written by the broker's account mapping, never by the tenant.",
        "examples": ["team-a"],
    },
    "service": {
        "description": "The reporting service's name: 1-64 letters, digits, '_' or '-'.",
        "examples": ["registry", "trainer", "inference", "orchestrator"],
    },
    "group": {
        "description": "A collective weight-transport group: 1-64 letters, digits, '_' or '-'.",
        "examples": ["default"],
    },
    "member": {
        "description": "A replica's member id in a collective group.",
        "examples": ["inference-0-1a2b3c4d"],
    },
    "progress_subject": {
        "description": "The whole subject a GenerateRequest names in progress_subject: an inbox "
        "of the requester, under _INBOX. (on a tenant's generate subject: _INBOX_<tenant>.). "
        "Replicas refuse a request naming any other subject.",
        "examples": ["_INBOX.Tq3Xw2cX8mLh0cV5q1Yz7A", "_INBOX_team-a.Tq3Xw2cX8mLh0cV5q1Yz7A"],
    },
}

MESSAGES: tuple[type[Event], ...] = ALL_EVENTS + COLLECTIVE_MESSAGES
"""Every message with a schema: the events, and the collective membership messages."""


# --- JSON Schema -------------------------------------------------------------------------------


def event_schema(cls: type[Event]) -> dict[str, Any]:
    """The standalone JSON Schema of one event class."""
    generated = msgspec.json.schema(cls)
    defs: dict[str, Any] = generated["$defs"]
    body = _finish_struct(defs.pop(cls.__name__), event_tag(cls))
    schema: dict[str, Any] = {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": f"urn:plexrl:events:v{SCHEMA_VERSION}:{event_tag(cls)}",
        **body,
    }
    if defs:
        schema["$defs"] = {name: _finish_struct(defs[name], None) for name in sorted(defs)}
    return schema


def record_schema(name: str) -> dict[str, Any]:
    """The standalone JSON Schema of one KV record type (see :data:`schemas.records.ALL_RECORDS`)."""
    cls = ALL_RECORDS[name]
    generated = msgspec.json.schema(cls)
    body = _finish_struct(generated["$defs"].pop(cls.__name__), None)
    return {"$schema": JSON_SCHEMA_DIALECT, "$id": f"urn:plexrl:records:{name}", **body}


def orch_config_schema() -> dict[str, Any]:
    """The JSON Schema of ``control/orch.toml`` (and of ``RunSubmitted.config`` once valid)."""
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": "urn:plexrl:config:orch_config",
        **_clean_descriptions(OrchConfig.model_json_schema()),
    }


def _finish_struct(schema: dict[str, Any], tag: str | None) -> dict[str, Any]:
    schema = _clean_descriptions(schema)
    if tag is not None:
        # msgspec writes a one-value enum; const says the same and reads better in other tools.
        schema["properties"]["type"] = {"const": tag}
        if "type" not in schema["required"]:
            schema["required"].insert(0, "type")
    schema.setdefault("additionalProperties", True)
    return schema


def _clean_descriptions(node: Any) -> Any:
    """Docstrings arrive indented; other languages' tools show descriptions as written."""
    if isinstance(node, dict):
        return {
            k: inspect.cleandoc(v)
            if k == "description" and isinstance(v, str)
            else _clean_descriptions(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_clean_descriptions(v) for v in node]
    return node


# --- AsyncAPI ----------------------------------------------------------------------------------


def asyncapi_document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document: every channel, its stream, payloads, operations and headers."""
    _, components = msgspec.json.schema_components(
        MESSAGES, ref_template="#/components/schemas/{name}"
    )
    tags = {cls.__name__: event_tag(cls) for cls in MESSAGES}
    schemas = {
        name: _finish_struct(components[name], tags.get(name)) for name in sorted(components)
    }
    schemas["Headers"] = HEADERS_SCHEMA

    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for ch in CHANNELS:
        channels[ch.id] = _channel(ch)
        if ch.reply:
            channels[_reply_id(ch)] = _reply_channel(ch)
        operations.update(_operations(ch))

    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "plexrl",
            "version": str(SCHEMA_VERSION),
            "description": _INFO_DESCRIPTION,
            "license": {"name": "Apache-2.0"},
        },
        "defaultContentType": "application/json",
        "servers": {
            "local": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "The default; --nats-url or PLEXRL_NATS_URL names another server.",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {
            "schemas": schemas,
            "messages": {event_tag(cls): _message(cls) for cls in sorted(MESSAGES, key=event_tag)},
            "parameters": _PARAMETERS,
        },
        "x-plexrl-streams": {
            s.name: {"subjects": list(s.subjects), "description": s.description} for s in STREAMS
        },
        "x-plexrl-kv-buckets": dict(KV_BUCKETS),
        "x-plexrl-kv-records": {
            bucket: f"{JSON_DIR}/{name}.json" for name, bucket in RECORD_BUCKETS.items()
        },
        "x-plexrl-object-stores": dict(OBJECT_STORES),
    }


_INFO_DESCRIPTION = f"""\
plexrl trains many LoRA reinforcement-learning runs of one language model on one shared
trainer. Its services talk only through these events on NATS JetStream.

Every event is a JSON object tagged by its "type" field and carrying "schema_version". JSON is
the canonical encoding; a publisher may send MessagePack and says so with the header
"Content-Type: application/msgpack". Readers ignore fields they do not know, so producers may add
fields. A message that fails to decode is terminated and reported on plexrl.errors.<service> as
an invalid_message event.

Run ids match {RUN_ID_PATTERN}. Example messages for every event are in
schemas/examples/."""


def _message(cls: type[Event]) -> dict[str, Any]:
    doc = inspect.cleandoc(cls.__doc__ or "")
    summary, _, description = doc.partition("\n\n")
    message: dict[str, Any] = {
        "name": event_tag(cls),
        "title": cls.__name__,
        "summary": " ".join(summary.split()),
    }
    if description:
        message["description"] = description
    message["contentType"] = "application/json"
    message["headers"] = {"$ref": "#/components/schemas/Headers"}
    message["payload"] = {"$ref": f"#/components/schemas/{cls.__name__}"}
    if "request_id" in cls.__struct_fields__:
        message["correlationId"] = {
            "description": "A GenerateResponse repeats its request's request_id.",
            "location": "$message.payload#/request_id",
        }
    return message


def _message_refs(events: tuple[type[Event], ...]) -> dict[str, Any]:
    return {event_tag(c): {"$ref": f"#/components/messages/{event_tag(c)}"} for c in events}


def _channel(ch: Channel) -> dict[str, Any]:
    if ch.stream is not None:
        where = f"Stream {ch.stream}."
    elif ch.queue_group is None:
        where = "Core NATS, no stream." + (" Request/reply." if ch.reply else "")
    else:
        where = (
            f"Core NATS request/reply, no stream; replicas share requests through the queue "
            f"group '{ch.queue_group}'."
        )
    channel: dict[str, Any] = {
        "address": ch.address,
        "summary": ch.summary,
        "description": f"{where} Producers: {ch.producers}. Consumers: {ch.consumers}.",
        "messages": _message_refs(ch.messages),
    }
    if ch.parameters:
        channel["parameters"] = {p: {"$ref": f"#/components/parameters/{p}"} for p in ch.parameters}
    if ch.stream is not None:
        channel["x-plexrl-stream"] = ch.stream
    if ch.queue_group is not None:
        channel["x-plexrl-queue-group"] = ch.queue_group
    return channel


def _reply_id(ch: Channel) -> str:
    return f"{ch.id}_reply"


def _reply_channel(ch: Channel) -> dict[str, Any]:
    return {
        # A null address is AsyncAPI's way to say the subject is chosen at run time: here the
        # requester's inbox, carried as the request's NATS reply subject.
        "address": None,
        "summary": f"the reply to {ch.address}",
        "description": "The requester's inbox: the NATS reply subject of the request.",
        "messages": _message_refs(ch.reply),
    }


def _operations(ch: Channel) -> dict[str, Any]:
    ops: dict[str, Any] = {}
    for action, who in (("send", ch.producers), ("receive", ch.consumers)):
        op: dict[str, Any] = {
            "action": action,
            "channel": {"$ref": f"#/channels/{ch.id}"},
            "summary": f"{'published' if action == 'send' else 'consumed'} by {who}",
            "messages": [
                {"$ref": f"#/channels/{ch.id}/messages/{event_tag(c)}"} for c in ch.messages
            ],
        }
        if action == "receive" and ch.queue_group is not None:
            op["bindings"] = {"nats": {"queue": ch.queue_group, "bindingVersion": "0.1.0"}}
        if ch.reply:
            reply_id = _reply_id(ch)
            op["reply"] = {
                "channel": {"$ref": f"#/channels/{reply_id}"},
                "messages": [
                    {"$ref": f"#/channels/{reply_id}/messages/{event_tag(c)}"} for c in ch.reply
                ],
            }
        ops[f"{ch.id}_{action}"] = op
    return ops


# --- files -------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Block-style multi-line strings, so descriptions read as text in the YAML file."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def _json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def _yaml_text(obj: Any) -> str:
    return yaml.dump(
        obj,
        Dumper=_Dumper,
        sort_keys=False,
        allow_unicode=True,
        width=100,
        default_flow_style=False,
    )


def generate() -> dict[str, str]:
    """Every generated file: its path relative to the schemas directory -> its text."""
    files = {f"{JSON_DIR}/{event_tag(cls)}.json": _json_text(event_schema(cls)) for cls in MESSAGES}
    files[f"{JSON_DIR}/{ORCH_CONFIG_FILE}"] = _json_text(orch_config_schema())
    for name in ALL_RECORDS:
        files[f"{JSON_DIR}/{name}.json"] = _json_text(record_schema(name))
    files[ASYNCAPI_FILE] = _yaml_text(asyncapi_document())
    return dict(sorted(files.items()))


def _committed(directory: Path) -> set[str]:
    """The files the export owns in ``directory``: everything generated, plus stale schemas."""
    owned = {f"{JSON_DIR}/{p.name}" for p in (directory / JSON_DIR).glob("*.json")}
    if (directory / ASYNCAPI_FILE).exists():
        owned.add(ASYNCAPI_FILE)
    return owned


@dataclass(frozen=True)
class Difference:
    """One file whose committed content is not what :func:`generate` produces."""

    path: str
    kind: Literal["missing", "differs", "stale"]
    diff: str = ""

    def __str__(self) -> str:
        what = {
            "missing": "is missing",
            "differs": "differs from the generated file",
            "stale": "is not generated any more",
        }[self.kind]
        return f"{self.path} {what}"


def compare(directory: Path) -> list[Difference]:
    """How the files in ``directory`` differ from freshly generated ones (empty: identical)."""
    expected = generate()
    out: list[Difference] = []
    for path in sorted(set(expected) | _committed(directory)):
        target = directory / path
        if path not in expected:
            out.append(Difference(path, "stale"))
        elif not target.exists():
            out.append(Difference(path, "missing"))
        else:
            current = target.read_text(encoding="utf-8")
            if current != expected[path]:
                diff = difflib.unified_diff(
                    current.splitlines(keepends=True),
                    expected[path].splitlines(keepends=True),
                    fromfile=f"{path} (committed)",
                    tofile=f"{path} (generated)",
                )
                out.append(Difference(path, "differs", "".join(diff)))
    return out


def write(directory: Path) -> list[Difference]:
    """Bring ``directory`` up to date: write what differs, delete stale schemas; return the changes."""
    expected = generate()
    changes = compare(directory)
    for change in changes:
        target = directory / change.path
        if change.kind == "stale":
            target.unlink()
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(expected[change.path], encoding="utf-8", newline="\n")
    return changes
