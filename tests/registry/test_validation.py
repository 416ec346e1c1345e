"""Config validation: the pydantic model, built-in limit hooks, named hooks, settings parsing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from schemas.config import OrchConfig
from services.config import SettingsError, load_settings
from services.registry.settings import RegistrySettings
from services.registry.validation import (
    HookLoadError,
    Validator,
    known_env_hook,
    load_hook,
    make_validator,
    max_lora_rank_hook,
)


def test_text_dict_and_bytes_give_the_same_verdict() -> None:
    v = make_validator(max_lora_rank=64, max_async_level=4)
    from_text = v.check_text('env = "copy"\nmax_steps = 5\n')
    from_dict = v.check_dict({"env": "copy", "max_steps": 5})
    assert from_text.ok and from_dict.ok
    assert from_text.digest == from_dict.digest == OrchConfig(env="copy", max_steps=5).digest()
    bad_utf8 = v.check_bytes(b'env = "\xff"\n')
    assert not bad_utf8.ok and "not UTF-8" in bad_utf8.error
    assert v.check_dict(["not", "a", "table"]).error.startswith("a run config is a table/object")


def test_a_submitted_config_must_survive_being_written_as_toml() -> None:
    v = make_validator(max_lora_rank=64, max_async_level=4)
    ok = v.check_submission({"env": "copy", "env_args": {"length": 5, "alphabet": ["a", "b"]}})
    assert ok.ok and ok.digest == v.check_dict(ok.config.to_dict() if ok.config else {}).digest
    verdict = v.check_submission({"env_args": {"length": None}})  # JSON null has no TOML form
    assert verdict.error == "config cannot be written as TOML: cannot write NoneType to TOML"


def test_the_first_failing_hook_gives_the_message() -> None:
    v = make_validator(max_lora_rank=8, max_async_level=1)
    verdict = v.check_dict({"model": {"lora": {"rank": 16}}, "max_async_level": 3})
    assert verdict.config is None and verdict.digest == ""
    assert verdict.error == (
        "model.lora.rank: 16 is above this registry's limit of 8 (the trainer's adapter slots "
        "are allocated for at most that rank); use a rank <= 8"
    )
    assert v.check_dict({"max_async_level": 3}).error.startswith(
        "max_async_level: 3 is above this registry's limit of 1"
    )
    assert max_lora_rank_hook(8)(OrchConfig()) == (True, "")


def test_plugin_environments_are_located_never_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "plexrl_boom_plugin"
    (pkg / "envs").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported the plugin package')\n")
    (pkg / "envs" / "__init__.py").write_text("raise RuntimeError('imported the env module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ok, message = known_env_hook(OrchConfig(env="plexrl_boom_plugin.envs:make"))
    assert (ok, message) == (True, "")
    assert "plexrl_boom_plugin" not in sys.modules
    ok, message = known_env_hook(OrchConfig(env="plexrl_boom_plugin.missing:make"))
    assert not ok and "plugin module 'plexrl_boom_plugin.missing'" in message
    assert known_env_hook(OrchConfig(env="json:loads")) == (True, "")
    for spec in ("reverse", "copy", "upper", "rotate", "add"):
        assert known_env_hook(OrchConfig(env=spec)) == (True, "")
    ok, message = known_env_hook(OrchConfig(env="json:"))
    assert not ok and "'package.module:factory'" in message


def test_load_hook_errors_say_what_is_wrong() -> None:
    assert load_hook("os.path:isabs") is not None
    with pytest.raises(HookLoadError, match="not of the form 'module:function'"):
        load_hook("os.path.isabs")
    with pytest.raises(HookLoadError, match="cannot import 'no_such_module_plexrl'"):
        load_hook("no_such_module_plexrl:f")
    with pytest.raises(HookLoadError, match="has no callable 'nothing_here'"):
        load_hook("os.path:nothing_here")
    with pytest.raises(HookLoadError, match="has no callable 'sep'"):
        load_hook("os:sep")  # exists, but is a string


def test_a_hook_returning_garbage_rejects_with_its_name() -> None:
    def sloppy(config: OrchConfig) -> tuple[bool, str]:
        return "yes"  # type: ignore[return-value]

    def silent_no(config: OrchConfig) -> tuple[bool, str]:
        return False, ""

    assert "returned 'yes', not (ok, message)" in Validator([sloppy]).check_dict({}).error
    assert Validator([silent_no]).check_dict({}).error.startswith("rejected by validation hook")


def test_settings_from_environment_and_flags(tmp_path: Path) -> None:
    env = {
        "PLEXRL_OUTPUT_DIR": str(tmp_path),
        "PLEXRL_MAX_RUNS": "6",
        "PLEXRL_VALIDATION_HOOKS": "a.b:c, d:e",
    }
    s = load_settings(RegistrySettings, None, {"max_runs": 3}, environ=env)
    assert (s.output_dir, s.max_runs, s.validation_hooks) == (tmp_path, 3, ["a.b:c", "d:e"])
    with pytest.raises(SettingsError, match="validation_hooks: Value error, 'nocolon'"):
        load_settings(RegistrySettings, None, {"validation_hooks": ["nocolon"]}, environ={})
    with pytest.raises(SettingsError, match="max_runs: Input should be greater than or equal"):
        load_settings(RegistrySettings, None, {"max_runs": 0}, environ={})
    with pytest.raises(SettingsError, match="consumer_name"):
        load_settings(RegistrySettings, None, {"consumer_name": "a.b"}, environ={})
    toml = tmp_path / "registry.toml"
    toml.write_text('max_runs = 7\nvalidation_hooks = ["m:f"]\nmax_lora_rank = 32\n')
    s = load_settings(RegistrySettings, toml, {"max_lora_rank": None}, environ={})
    assert (s.max_runs, s.validation_hooks, s.max_lora_rank) == (7, ["m:f"], 32)
    s = load_settings(RegistrySettings, toml, {}, environ={"PLEXRL_MAX_RUNS": "9"})
    assert s.max_runs == 9  # the environment overrides the file
