"""Config: one schema (schema.py, assembling fields.py, sections_train.py, sections_infra.py), TOML +
CLI loading (manager.py), --help (help.py), the resolved TOML (toml_write.py), up-front checks (validate.py, with section_checks.py and io_checks.py)."""

from torchtitan_loom.config.help import help_requested, help_text
from torchtitan_loom.config.manager import ConfigError, load_config
from torchtitan_loom.config.schema import JobConfig
from torchtitan_loom.config.toml_write import to_toml

__all__ = [
    "ConfigError",
    "JobConfig",
    "help_requested",
    "help_text",
    "load_config",
    "to_toml",
]
