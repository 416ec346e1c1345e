"""Service settings: one pydantic model per service, loaded by one small loader.

Precedence, lowest to highest: field defaults, the TOML file given with ``--config``,
environment variables ``PLEXRL_<FIELD>`` (upper case), then command-line flags that were given.
"""

from services.config.loader import SettingsError, add_common_args, load_settings

__all__ = ["SettingsError", "add_common_args", "load_settings"]
