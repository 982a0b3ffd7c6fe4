"""Config: one schema (schema.py, assembling fields.py, sections_train.py, sections_infra.py), TOML +
CLI loading (manager.py), up-front checks (validate.py, with section_checks.py and io_checks.py)."""

from torchtitan_loom.config.manager import ConfigError, help_text, load_config, to_toml
from torchtitan_loom.config.schema import JobConfig

__all__ = ["ConfigError", "JobConfig", "help_text", "load_config", "to_toml"]
