"""The config's error type (its own module: the TOML reader and the loader both raise it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan_loom.config.schema import JobConfig


class ConfigError(ValueError):
    """A bad config: one line per problem, each naming the key and what would be valid.

    ``partial`` (set by load_config): the config built from every key that was valid, so the
    cross-field checks (validate.py) can still run and a user sees every problem in one run."""

    def __init__(self, message: str, partial: JobConfig | None = None) -> None:
        super().__init__(message)
        self.partial = partial
