"""The committed JSON Schemas and AsyncAPI document are exactly what the code generates."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from jsonschema import Draft202012Validator

from schemas import cli as schemas_cli
from schemas import export
from schemas.collective import COLLECTIVE_MESSAGES
from schemas.events import ALL_EVENTS, Event, event_tag
from schemas.records import ALL_RECORDS
from schemas.subjects import CHANNELS

from .vectors import JSON_DIR, REPO_ROOT, SCHEMAS_DIR, TAGS, committed_schema


def _copy_committed(tmp_path: Path) -> Path:
    target = tmp_path / "schemas"
    shutil.copytree(JSON_DIR, target / "json")
    shutil.copy(SCHEMAS_DIR / "asyncapi.yaml", target / "asyncapi.yaml")
    return target


def _run_schemas_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="plexrl")
    schemas_cli.register(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    return int(args.func(args))


def _plexrl(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services", *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_generated_files_are_one_schema_per_event_plus_config_and_asyncapi() -> None:
    files = export.generate()
    expected = {f"json/{tag}.json" for tag in TAGS} | {"json/orch_config.json", "asyncapi.yaml"}
    expected |= {f"json/{name}.json" for name in ALL_RECORDS}
    assert set(files) == expected
    assert len(ALL_EVENTS) == 26
    assert len(TAGS) == len(ALL_EVENTS) + len(COLLECTIVE_MESSAGES) == 32


def test_committed_files_equal_generated(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    changes = export.write(fresh)
    assert sorted(c.path for c in changes) == sorted(export.generate())
    assert {c.kind for c in changes} == {"missing"}
    for rel in export.generate():
        assert (fresh / rel).read_bytes() == (SCHEMAS_DIR / rel).read_bytes(), rel
    assert export.compare(SCHEMAS_DIR) == []


def test_generation_is_deterministic() -> None:
    assert export.generate() == export.generate()


def test_plexrl_schemas_check_passes_on_the_committed_files() -> None:
    proc = _plexrl("schemas", "check")
    assert proc.returncode == 0, proc.stderr
    assert "schemas match the code" in proc.stdout


def test_plexrl_schemas_check_fails_on_a_tampered_copy(tmp_path: Path) -> None:
    copy = _copy_committed(tmp_path)
    target = copy / "json" / "run_forgotten.json"
    schema = json.loads(target.read_text())
    schema["properties"]["idx"]["maximum"] = 9999
    target.write_text(json.dumps(schema, indent=2) + "\n")

    proc = _plexrl("schemas", "check", "--dir", str(copy))

    assert proc.returncode == 1
    assert "json/run_forgotten.json differs from the generated file" in proc.stderr
    assert '-      "maximum": 9999' in proc.stderr
    assert '+      "maximum": 4095' in proc.stderr
    assert "plexrl schemas export" in proc.stderr


def test_export_repairs_a_copy_and_reports_each_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = _copy_committed(tmp_path)
    (copy / "asyncapi.yaml").unlink()
    (copy / "json" / "weights_ready.json").write_text("{}\n")
    (copy / "json" / "run_renamed.json").write_text("{}\n")

    assert {(d.path, d.kind) for d in export.compare(copy)} == {
        ("asyncapi.yaml", "missing"),
        ("json/weights_ready.json", "differs"),
        ("json/run_renamed.json", "stale"),
    }
    assert _run_schemas_cli("schemas", "check", "--dir", str(copy)) == 1
    err = capsys.readouterr().err
    assert "3 file(s) out of date" in err
    assert "json/run_renamed.json is not generated any more" in err

    assert _run_schemas_cli("schemas", "export", "--dir", str(copy)) == 0
    out = capsys.readouterr().out
    assert f"wrote {copy / 'asyncapi.yaml'}" in out
    assert f"wrote {copy / 'json' / 'weights_ready.json'}" in out
    assert f"removed {copy / 'json' / 'run_renamed.json'}" in out
    assert not (copy / "json" / "run_renamed.json").exists()

    assert _run_schemas_cli("schemas", "check", "--dir", str(copy)) == 0
    assert _run_schemas_cli("schemas", "export", "--dir", str(copy)) == 0
    assert "up to date" in capsys.readouterr().out


@pytest.mark.parametrize("name", [*TAGS, "orch_config", *ALL_RECORDS])
def test_each_schema_is_a_standalone_draft_2020_12_schema(name: str) -> None:
    schema = committed_schema(name)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"].startswith("urn:plexrl:")
    defs = schema.get("$defs", {})
    for ref in _refs(schema):
        # Only local references: each file must be usable without the others.
        assert ref.startswith("#/$defs/"), ref
        assert ref.removeprefix("#/$defs/") in defs, ref


@pytest.mark.parametrize("cls", ALL_EVENTS, ids=event_tag)
def test_event_schema_requires_its_type_tag_and_tolerates_unknown_fields(cls: type[Event]) -> None:
    tag = event_tag(cls)
    schema = committed_schema(tag)
    assert schema["title"] == cls.__name__
    assert schema["type"] == "object"
    assert schema["properties"]["type"] == {"const": tag}
    assert schema["required"][0] == "type"
    assert schema["additionalProperties"] is True
    assert list(schema["properties"]) == ["type", *cls.__struct_fields__]
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    required = [f.encode_name for f in info.fields if f.required]
    assert schema["required"] == ["type", *required]


def test_orch_config_schema_forbids_unknown_keys_everywhere() -> None:
    schema = committed_schema("orch_config")
    assert schema["title"] == "OrchConfig"
    assert sorted(schema["$defs"]) == [
        "AdvantageConfig",
        "CkptConfig",
        "EvalConfig",
        "LoraConfig",
        "LossConfig",
        "ModelConfig",
        "OptimConfig",
        "SamplingConfig",
    ]
    for obj in [schema, *schema["$defs"].values()]:
        assert obj["additionalProperties"] is False, obj["title"]
    assert schema["$defs"]["LoraConfig"]["properties"]["rank"]["maximum"] == 256


# --- AsyncAPI ----------------------------------------------------------------------------------

DESIGN_TABLE = {
    # DESIGN.md, "Subjects, streams and buckets": address -> (stream, payload tags)
    "plexrl.runs.submit": ("PLEXRL_RUNS", ["run_submitted"]),
    "plexrl.runs.discovered": ("PLEXRL_RUNS", ["run_discovered"]),
    "plexrl.runs.invalid": ("PLEXRL_RUNS", ["run_config_invalid"]),
    "plexrl.runs.evict": ("PLEXRL_RUNS", ["evict_requested"]),
    "plexrl.runs.evicted": ("PLEXRL_RUNS", ["run_evicted"]),
    "plexrl.runs.forgotten": ("PLEXRL_RUNS", ["run_forgotten"]),
    "plexrl.rollouts.{run_id}": ("PLEXRL_ROLLOUTS", ["rollout_batch"]),
    "plexrl.weights.{run_id}": ("PLEXRL_WEIGHTS", ["weights_ready"]),
    "plexrl.inference.generate": (None, ["generate_request"]),
    "plexrl.inference.cancel": (None, ["generate_cancel"]),
    "{progress_subject}": (None, ["generate_progress"]),
    "plexrl.registry.list": (None, ["run_list_request"]),
    "plexrl.errors.{service}": ("PLEXRL_ERRORS", ["invalid_message", "service_error"]),
    "plexrl.collective.{group}.join": (None, ["collective_join"]),
    "plexrl.collective.{group}.leave": (None, ["collective_leave"]),
    "plexrl.collective.{group}.formed": (None, ["collective_formed"]),
    "plexrl.collective.{group}.alive.{member}": (None, ["collective_ping"]),
    "plexrl.train.forward_backward": (None, ["forward_backward_request"]),
    "plexrl.train.optim_step": (None, ["optim_step_request"]),
    "plexrl.train.save_weights": (None, ["save_weights_request"]),
    "plexrl.train.load_weights": (None, ["load_weights_request"]),
    "plexrl.train.checkpoints": (None, ["checkpoints_request"]),
    # in the services' account, a tenant's writes before the registry stores them
    "plexrl.ingest.{tenant}.submit": (None, ["run_submitted"]),
    "plexrl.ingest.{tenant}.evict": (None, ["evict_requested"]),
    "plexrl.ingest.{tenant}.rollouts.{run_id}": (None, ["rollout_batch"]),
}


@pytest.fixture(scope="module")
def asyncapi() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((SCHEMAS_DIR / "asyncapi.yaml").read_text())
    return doc


def test_asyncapi_yaml_parses_to_the_generated_document(asyncapi: dict[str, Any]) -> None:
    assert asyncapi == export.asyncapi_document()
    assert asyncapi["asyncapi"] == "3.0.0"
    assert asyncapi["defaultContentType"] == "application/json"


def test_asyncapi_lists_every_subject_of_the_design_table(asyncapi: dict[str, Any]) -> None:
    by_address = {c["address"]: c for c in asyncapi["channels"].values() if c["address"]}
    assert set(by_address) == set(DESIGN_TABLE)
    for address, (stream, tags) in DESIGN_TABLE.items():
        channel = by_address[address]
        assert channel.get("x-plexrl-stream") == stream, address
        if stream:
            assert channel["description"].startswith(f"Stream {stream}.")
        assert list(channel["messages"]) == tags
        for tag in tags:
            assert channel["messages"][tag] == {"$ref": f"#/components/messages/{tag}"}
        params = [p.strip("{}") for p in address.split(".") if p.startswith("{")]
        assert sorted(channel.get("parameters", {})) == sorted(params)


def test_asyncapi_messages_carry_their_payload_schema_and_headers(
    asyncapi: dict[str, Any],
) -> None:
    components = asyncapi["components"]
    assert sorted(components["messages"]) == TAGS
    for cls in ALL_EVENTS:
        message = components["messages"][event_tag(cls)]
        assert message["payload"] == {"$ref": f"#/components/schemas/{cls.__name__}"}
        assert message["headers"] == {"$ref": "#/components/schemas/Headers"}
        payload = components["schemas"][cls.__name__]
        assert payload["properties"]["type"] == {"const": event_tag(cls)}
    headers = components["schemas"]["Headers"]["properties"]
    assert set(headers) == {"Nats-Msg-Id", "traceparent", "Content-Type"}
    assert "application/msgpack" in headers["Content-Type"]["enum"]


def test_asyncapi_generate_is_request_reply_on_the_inference_queue_group(
    asyncapi: dict[str, Any],
) -> None:
    ops = asyncapi["operations"]
    send, receive = ops["inference_generate_send"], ops["inference_generate_receive"]
    assert (send["action"], receive["action"]) == ("send", "receive")
    assert receive["bindings"]["nats"]["queue"] == "inference"
    reply_ref = "#/channels/inference_generate_reply/messages/generate_response"
    assert send["reply"]["messages"] == [{"$ref": reply_ref}]
    assert receive["reply"]["messages"] == [{"$ref": reply_ref}]
    assert asyncapi["channels"]["inference_generate_reply"]["address"] is None


def test_asyncapi_has_a_send_and_a_receive_operation_per_channel(
    asyncapi: dict[str, Any],
) -> None:
    ops = asyncapi["operations"]
    assert len(ops) == 2 * len(CHANNELS)
    for ch in CHANNELS:
        for action in ("send", "receive"):
            op = ops[f"{ch.id}_{action}"]
            assert op["action"] == action
            assert op["channel"] == {"$ref": f"#/channels/{ch.id}"}
            assert [m["$ref"].rsplit("/", 1)[1] for m in op["messages"]] == [
                event_tag(c) for c in ch.messages
            ]


def test_asyncapi_references_all_resolve(asyncapi: dict[str, Any]) -> None:
    refs = list(_refs(asyncapi))
    assert len(refs) > 50
    for ref in refs:
        node: Any = asyncapi
        for part in ref.removeprefix("#/").split("/"):
            assert isinstance(node, dict) and part in node, ref
            node = node[part]


def test_asyncapi_lists_streams_buckets_and_object_store(asyncapi: dict[str, Any]) -> None:
    assert asyncapi["x-plexrl-streams"]["PLEXRL_ROLLOUTS"]["subjects"] == ["plexrl.rollouts.>"]
    assert sorted(asyncapi["x-plexrl-streams"]) == [
        "PLEXRL_ERRORS",
        "PLEXRL_ROLLOUTS",
        "PLEXRL_RUNS",
        "PLEXRL_WEIGHTS",
    ]
    assert sorted(asyncapi["x-plexrl-kv-buckets"]) == ["plexrl-progress", "plexrl-registry"]
    assert list(asyncapi["x-plexrl-object-stores"]) == ["plexrl-weights"]


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []
