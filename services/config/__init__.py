"""Service settings: one pydantic model per service, loaded by one small loader.

Precedence, lowest to highest: field defaults, the TOML file given with ``--config``,
environment variables ``PLEXRL_<FIELD>`` (upper case), then command-line flags that were given.
The flags are generated from the model (:mod:`services.config.flags`).
"""

from services.config.flags import (
    add_common_args,
    add_settings_flags,
    flag_values,
    nats_url,
    settings_from_args,
)
from services.config.loader import SettingsError, env_name, load_settings
from services.config.process import DEFAULT_NATS_URL, ProcessSettings, process_settings

__all__ = [
    "DEFAULT_NATS_URL",
    "ProcessSettings",
    "SettingsError",
    "add_common_args",
    "add_settings_flags",
    "env_name",
    "flag_values",
    "load_settings",
    "nats_url",
    "process_settings",
    "settings_from_args",
]
