"""Environments: where a run's prompts come from and how its completions are scored."""

from services.orchestrator.envs.arithmetic import AddEnv
from services.orchestrator.envs.base import PROMPT_CHARACTERS, Environment, Prompt
from services.orchestrator.envs.loader import (
    BUILTIN_ENVS,
    EnvFactory,
    EnvLoadError,
    load_environment,
)
from services.orchestrator.envs.strings import CopyEnv, ReverseEnv

__all__ = [
    "BUILTIN_ENVS",
    "PROMPT_CHARACTERS",
    "AddEnv",
    "CopyEnv",
    "EnvFactory",
    "EnvLoadError",
    "Environment",
    "Prompt",
    "ReverseEnv",
    "load_environment",
]
