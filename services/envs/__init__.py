"""Environments: where a run's prompts come from and how its completions are scored.

A shared library: the orchestrator draws and scores prompts with it, the registry checks that a
run's ``env`` exists, and the warm start trains the tiny model on its demonstrations. It imports
neither torch nor any service, so the registry's validation stays light; the environment
libraries' adapters (``reasoning_gym_env``, ``verifiers_env``) are imported only when a run
names them.
"""

from services.envs.arithmetic import AddEnv
from services.envs.base import PROMPT_CHARACTERS, Environment, Message, Prompt, SplitError
from services.envs.loader import BUILTIN_ENVS, LIBRARY_ENVS, EnvLoadError, load_environment
from services.envs.prompts import (
    decode_ids,
    encode_text,
    end_of_turn_ids,
    has_chat_template,
    prompt_token_ids,
    render_chat,
    score_completion,
)
from services.envs.strings import CopyEnv, ReverseEnv, RotateEnv, UpperEnv

__all__ = [
    "BUILTIN_ENVS",
    "LIBRARY_ENVS",
    "PROMPT_CHARACTERS",
    "AddEnv",
    "CopyEnv",
    "EnvLoadError",
    "Environment",
    "Message",
    "Prompt",
    "ReverseEnv",
    "RotateEnv",
    "SplitError",
    "UpperEnv",
    "decode_ids",
    "encode_text",
    "end_of_turn_ids",
    "has_chat_template",
    "load_environment",
    "prompt_token_ids",
    "render_chat",
    "score_completion",
]
