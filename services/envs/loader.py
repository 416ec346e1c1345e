"""Resolve a run's ``env`` setting to an :class:`~.base.Environment`.

``env`` names a built-in (``reverse``, ``copy``, ``upper``, ``rotate``, ``add``), a task of an environment library
(``reasoning_gym:<task>``, ``verifiers:<taskset id>``; each library an optional extra, imported
only when named) or a plugin as ``package.module:factory``. A factory is called as
``factory(seed=seed, **env_args)`` and must return an Environment; a class deriving from
Environment is a factory.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from services.envs.arithmetic import AddEnv
from services.envs.base import Environment
from services.envs.strings import CopyEnv, ReverseEnv, RotateEnv, UpperEnv

EnvFactory = Callable[..., Environment]

BUILTIN_ENVS: dict[str, EnvFactory] = {
    "reverse": ReverseEnv,
    "copy": CopyEnv,
    "upper": UpperEnv,
    "rotate": RotateEnv,
    "add": AddEnv,
}


LIBRARY_ENVS: dict[str, tuple[str, str]] = {
    "reasoning_gym": ("services.envs.reasoning_gym_env:reasoning_gym_env", "reasoning-gym"),
    "verifiers": ("services.envs.verifiers_env:verifiers_env", "verifiers"),
}
"""Library prefix -> (the factory called as ``factory(name, seed=seed, **env_args)``, the
plexrl extra that installs the library)."""


class EnvLoadError(ValueError):
    """An ``env`` setting that does not give an environment; the message says what to change."""


def load_environment(spec: str, seed: int, **env_args: Any) -> Environment:
    """The environment named by ``spec``, built with ``seed`` and ``env_args``."""
    library, _, name = spec.partition(":")
    if library in LIBRARY_ENVS:
        factory = _library_factory(spec, library, name)
    else:
        factory = BUILTIN_ENVS.get(spec) or _import_factory(spec)
    try:
        env = factory(seed=seed, **env_args)
    except (TypeError, ValueError, ImportError, AttributeError) as exc:
        raise EnvLoadError(
            f"environment {spec!r} rejected seed={seed} env_args={env_args}: {exc}"
        ) from exc
    if not isinstance(env, Environment):
        raise EnvLoadError(
            f"environment factory {spec!r} returned {type(env).__name__}, not an Environment; "
            "return an instance of a subclass of services.envs.Environment"
        )
    if not isinstance(getattr(env, "name", None), str) or not env.name:
        raise EnvLoadError(
            f"environment {spec!r} has no name; set the class attribute 'name' to a non-empty str"
        )
    return env


def _library_factory(spec: str, library: str, name: str) -> EnvFactory:
    target, extra = LIBRARY_ENVS[library]
    if not name:
        raise EnvLoadError(f"environment {spec!r} names no task: use '{library}:<name>'")
    if importlib.util.find_spec(library) is None:
        raise EnvLoadError(
            f"environment {spec!r} needs the {library} library: pip install 'plexrl[{extra}]'"
        )
    factory = _import_factory(target)
    return functools.partial(factory, name)


def _import_factory(spec: str) -> EnvFactory:
    builtins = ", ".join(sorted(BUILTIN_ENVS))
    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise EnvLoadError(
            f"unknown environment {spec!r}: use a built-in ({builtins}) "
            "or a plugin as 'package.module:factory'"
        )
    if not module_name or not attr:
        raise EnvLoadError(
            f"environment {spec!r} is not of the form 'package.module:factory' "
            f"(built-ins: {builtins})"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvLoadError(
            f"environment {spec!r}: cannot import module {module_name!r} ({exc}); "
            "check the name and that its package is installed or on PYTHONPATH"
        ) from exc
    factory = getattr(module, attr, None)
    if factory is None:
        raise EnvLoadError(f"environment {spec!r}: module {module_name!r} has no {attr!r}")
    if not callable(factory):
        raise EnvLoadError(
            f"environment {spec!r}: {module_name}.{attr} is a {type(factory).__name__}, "
            "not a callable factory"
        )
    return factory  # type: ignore[no-any-return]
