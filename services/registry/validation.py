"""Is a run's config acceptable to this registry? The pydantic model, then validation hooks.

A hook is a callable ``(OrchConfig) -> (ok, message)``, the reference MultiRunManager's
``register_config_validation_hook``. Built-in hooks enforce the registry's own limits (the
largest LoRA rank the trainer's slots can hold, the largest ``max_async_level``, environments
that exist); extra hooks are named on the command line as ``module:function``.

Everything here is pure: text or a dict in, a :class:`Verdict` out. The registry decides what a
verdict means for files, the index pool and the bus.

Told the deployment's model (``model``, and ``target_modules`` when the trainer is given them),
the registry also checks that every LoRA target resolves to a layer the trainer's multi-LoRA
layer can wrap (:func:`check_model_targets`). A run names neither the model nor the targets
(both belong to the deployment: one base model, one set of adapter slots), so every run would
get the same answer: the check runs once, when the validator is made, and a failure stops the
registry at start-up (exit 2) with the module's name and type instead of admitting runs the
trainer cannot train. Reading the model's ``config.json`` is the one file access of this module.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

from schemas.config import (
    ConfigError,
    OrchConfig,
    dump_toml,
    orch_config_from_dict,
    parse_orch_config,
)

ValidationHook = Callable[[OrchConfig], tuple[bool, str]]


class HookLoadError(ValueError):
    """A ``module:function`` hook name that does not name a callable."""


class DeploymentError(ValueError):
    """The deployment's model cannot carry LoRA on its targets: no run could train on it."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of validating one config: ``config`` when accepted, ``error`` when not."""

    config: OrchConfig | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.config is not None

    @property
    def digest(self) -> str:
        """The normalised config's digest (empty for a rejected config)."""
        return self.config.digest() if self.config is not None else ""


def file_digest(data: bytes) -> str:
    """Digest of a file's bytes: tells a changed ``orch.toml`` from a touched one."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- built-in hooks -------------------------------------------------------------------------


def max_lora_rank_hook(limit: int) -> ValidationHook:
    """Reject a LoRA rank the trainer's adapter slots cannot hold."""
    why = " (the trainer's adapter slots are allocated for at most that rank)"
    return _at_most("model.lora.rank", lambda c: c.model.lora.rank, limit, why, "a rank")


def max_async_level_hook(limit: int) -> ValidationHook:
    """Reject a run that wants to run further ahead of its weights than this registry allows."""
    return _at_most("max_async_level", lambda c: c.max_async_level, limit, "", "a value")


def _at_most(
    field: str, get: Callable[[OrchConfig], int], limit: int, why: str, what: str
) -> ValidationHook:
    def check(config: OrchConfig) -> tuple[bool, str]:
        value = get(config)
        if value > limit:
            return False, (
                f"{field}: {value} is above this registry's limit of {limit}{why}; "
                f"use {what} <= {limit}"
            )
        return True, ""

    return check


def known_env_hook(config: OrchConfig) -> tuple[bool, str]:
    """Accept a built-in environment, or a plugin whose module can be found.

    A plugin is only located on the import path, never imported (not even its parent
    packages): importing it could pull in heavy dependencies or run arbitrary code inside the
    registry.
    """
    # The shared environments library imports nothing heavy.
    from services.envs import BUILTIN_ENVS

    spec = config.env
    if spec in BUILTIN_ENVS:
        return True, ""
    builtins = ", ".join(sorted(BUILTIN_ENVS))
    module_name, sep, attr = spec.partition(":")
    if not sep:
        return False, (
            f"env: unknown environment {spec!r}; use a built-in ({builtins}) "
            "or a plugin as 'package.module:factory'"
        )
    if not module_name or not attr or not attr.isidentifier():
        return False, f"env: {spec!r} is not of the form 'package.module:factory'"
    try:
        found = _locate(module_name)
    except (ImportError, ValueError) as exc:
        return False, f"env: cannot locate module {module_name!r} of plugin {spec!r}: {exc}"
    if found is None:
        return False, (
            f"env: plugin module {module_name!r} of {spec!r} is not installed; install its "
            "package or put it on PYTHONPATH of the registry and the orchestrator"
        )
    return True, ""


def _locate(module_name: str) -> ModuleSpec | None:
    """Find ``a.b.c`` without importing ``a`` or ``a.b``.

    ``importlib.util.find_spec("a.b")`` imports the parent package ``a`` first; walking the
    package search paths by hand executes nothing.
    """
    parts = module_name.split(".")
    found = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if found is None or found.submodule_search_locations is None:
            return None
        found = importlib.machinery.PathFinder.find_spec(
            ".".join(parts[: i + 1]), list(found.submodule_search_locations)
        )
    return found


def load_hook(name: str) -> ValidationHook:
    """The callable named ``module:function``; :class:`HookLoadError` says what is wrong."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise HookLoadError(f"validation hook {name!r} is not of the form 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HookLoadError(
            f"validation hook {name!r}: cannot import {module_name!r}: {exc}"
        ) from None
    hook = getattr(module, attr, None)
    if hook is None or not callable(hook):
        raise HookLoadError(f"validation hook {name!r}: {module_name} has no callable {attr!r}")
    return hook  # type: ignore[no-any-return]


# --- the deployment's model --------------------------------------------------------------


def check_model_targets(model: Path, target_modules: Sequence[str] | None = None) -> list[str]:
    """The module paths the trainer's LoRA wraps in ``model``; DeploymentError when it cannot.

    ``target_modules`` None takes the family's default, as the trainer does. Only
    ``config.json`` is read: the model is built on the meta device, so a large model costs no
    memory. The error names the first target that is not an ``nn.Linear`` or ``Conv1D`` layer,
    with its type (a whole block, a mixture of experts' fused expert weights...).
    """
    # torch and transformers: imported only by a registry told the model.
    from services.model.families import check_targets

    try:
        return check_targets(model, target_modules)
    except ValueError as exc:
        raise DeploymentError(
            f"model {model}: {exc} (the trainer would refuse the same targets at start-up, so "
            "no run could train on this deployment)"
        ) from None


# --- the validator --------------------------------------------------------------------------


class Validator:
    """The pydantic model plus every hook, in order; the first failing hook's message wins."""

    def __init__(self, hooks: Iterable[ValidationHook] = ()) -> None:
        self.hooks: list[ValidationHook] = list(hooks)

    def check_text(self, text: str) -> Verdict:
        """Validate the text of an ``orch.toml``."""
        return self._check(parse_orch_config, text)

    def check_bytes(self, data: bytes) -> Verdict:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return Verdict(None, f"control/orch.toml is not UTF-8 text ({exc.reason})")
        return self.check_text(text)

    def check_dict(self, data: Any) -> Verdict:
        """Validate a config given as an object (``RunSubmitted.config``)."""
        return self._check(orch_config_from_dict, data)

    def check_submission(self, data: Any) -> Verdict:
        """Validate a submitted config that will be written to ``orch.toml``: it must also
        read back from that file as exactly the same config (a restart reads the file)."""
        verdict = self.check_dict(data)
        if verdict.config is None:
            return verdict
        try:
            again = self.check_text(dump_toml(verdict.config.to_dict()))
        except ConfigError as exc:
            return Verdict(None, f"config cannot be written as TOML: {exc}")
        if again.digest != verdict.digest:
            return Verdict(None, f"config does not survive a TOML round trip: {again.error}")
        return verdict

    def _check(self, parse: Callable[[Any], OrchConfig], data: Any) -> Verdict:
        try:
            config = parse(data)
        except ConfigError as exc:
            return Verdict(None, str(exc))
        for hook in self.hooks:
            name = getattr(hook, "__qualname__", repr(hook))
            # A hook is code the operator plugged in: its failure rejects the run, it must not
            # take the registry down.
            try:
                result = hook(config)
            except Exception as exc:
                return Verdict(None, f"validation hook {name} raised {type(exc).__name__}: {exc}")
            if not (isinstance(result, tuple) and len(result) == 2):
                return Verdict(
                    None, f"validation hook {name} returned {result!r}, not (ok, message)"
                )
            ok, message = result
            if not ok:
                return Verdict(None, str(message) or f"rejected by validation hook {name}")
        return Verdict(config)


def make_validator(
    max_lora_rank: int,
    max_async_level: int,
    hook_names: Sequence[str] = (),
    *,
    model: Path | None = None,
    target_modules: Sequence[str] | None = None,
) -> Validator:
    """Built-in hooks for the registry's limits, then the named hooks.

    With ``model``, first checks the deployment's LoRA targets (:func:`check_model_targets`);
    DeploymentError when a run could not train on it, HookLoadError for a hook that does not
    load.
    """
    if model is not None:
        check_model_targets(model, target_modules)
    hooks = [max_lora_rank_hook(max_lora_rank), max_async_level_hook(max_async_level)]
    return Validator([*hooks, known_env_hook, *(load_hook(n) for n in hook_names)])
