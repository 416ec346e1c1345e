"""Run configs: the example TOML files load or fail with a message naming the offending key, and
the committed JSON Schema of the config agrees with the pydantic model."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from schemas.config import ConfigError, OrchConfig, load_orch_config, orch_config_from_dict
from schemas.events import RunSubmitted

from .vectors import ORCH_EXAMPLES_DIR, expected_errors, validator

VALID = sorted(ORCH_EXAMPLES_DIR.glob("valid_*.toml"))
INVALID = sorted(ORCH_EXAMPLES_DIR.glob("invalid_*.toml"))
EXPECTED = expected_errors(ORCH_EXAMPLES_DIR)


def test_examples_cover_the_cases_that_matter() -> None:
    assert len(VALID) >= 3
    assert set(EXPECTED) == {p.name for p in INVALID}
    assert {"invalid_syntax.toml", "invalid_unknown_key.toml", "invalid_lora_rank.toml"} <= set(
        EXPECTED
    )


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_config_loads_and_matches_the_json_schema(path: Path) -> None:
    config = load_orch_config(path)
    raw = tomllib.loads(path.read_text())
    assert [e.message for e in validator("orch_config").iter_errors(raw)] == []
    # Defaults filled in, the normalised config is valid too, and it is what travels on the wire.
    normalised = config.to_dict()
    assert [e.message for e in validator("orch_config").iter_errors(normalised)] == []
    assert orch_config_from_dict(normalised) == config
    event = RunSubmitted(run_id="run_abc123", config=normalised)
    assert orch_config_from_dict(event.config).digest() == config.digest()


def test_the_design_example_reads_as_written() -> None:
    config = load_orch_config(ORCH_EXAMPLES_DIR / "valid_minimal.toml")
    assert (config.env, config.max_steps, config.batch_size, config.group_size) == (
        "reverse",
        200,
        8,
        8,
    )
    assert config.model.lora.rank == 8
    assert config.model.lora.alpha == 16.0
    assert config.optim.lr == 1e-3
    assert config.ckpt.interval == 50


def test_the_full_example_sets_every_key_away_from_its_default() -> None:
    full = load_orch_config(ORCH_EXAMPLES_DIR / "valid_full.toml").to_dict()
    default = OrchConfig().to_dict()

    def leaves(d: dict[str, object], prefix: str = "") -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in d.items():
            if isinstance(v, dict) and k not in ("env_args", "labels"):
                out.update(leaves(v, f"{prefix}{k}."))
            else:
                out[prefix + k] = v
        return out

    same = [k for k, v in leaves(full).items() if leaves(default)[k] == v]
    # top_p admits only its default, 1, until the trainer scores tokens under the same nucleus.
    assert same == ["sampling.top_p"]


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_config_names_the_offending_key(path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_orch_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    for fragment in EXPECTED[path.name]:
        assert fragment in message, message


@pytest.mark.parametrize(
    "path", [p for p in INVALID if p.name != "invalid_syntax.toml"], ids=lambda p: p.name
)
def test_invalid_config_fails_the_json_schema_too(path: Path) -> None:
    raw = tomllib.loads(path.read_text())
    assert list(validator("orch_config").iter_errors(raw)) != []


def test_config_schema_file_is_the_pydantic_schema() -> None:
    committed = json.loads(
        (ORCH_EXAMPLES_DIR.parent.parent / "json" / "orch_config.json").read_text()
    )
    generated = OrchConfig.model_json_schema()
    assert committed["properties"] == generated["properties"]
    assert committed["$defs"].keys() == generated["$defs"].keys()


def test_labels_with_dots_and_quotes_survive_the_toml_round_trip() -> None:
    """Run labels are free-form: a key such as ``tinker.session`` must not become a table."""
    from schemas.config import dump_toml, orch_config_from_dict, parse_orch_config

    labels = {"tinker.session": "session-1", "user.my key": 'say "hi"', "team": "a"}
    config = orch_config_from_dict({"labels": labels, "driver": "commands"})
    again = parse_orch_config(dump_toml(config.to_dict()))
    assert again.labels == labels and again.digest() == config.digest()
