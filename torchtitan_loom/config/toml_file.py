"""Reading a config file: a bounded, non-blocking read of a regular file, parsed as TOML, and its
tables flattened to dotted keys. Every problem is a one-line ConfigError naming the file."""

from __future__ import annotations

import os
import stat
import sys
from typing import Any

from torchtitan_loom.components.runtime.messages import shorten
from torchtitan_loom.config.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# A config is a few KiB; a bigger file is not one (and parsing it would keep the user waiting).
MAX_CONFIG_BYTES = 1 << 20
# [a.b.c] tables deeper than TorchTitan's [quantize.linear.float8]: no key of the schema is.
MAX_TABLE_DEPTH = 4


def read_toml(path: str) -> dict[str, Any]:
    """The parsed file: a regular file (a FIFO is refused, not waited on; a link to one is
    followed, configs are often linked) of at most MAX_CONFIG_BYTES, valid TOML."""
    where = f"job.config_file: '{path}'"
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"job.config_file: no such file '{path}'") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ConfigError(
            f"{where} cannot be opened: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where} is not a regular file (a FIFO, device or folder)")
        data = fh.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where} is over {MAX_CONFIG_BYTES >> 20} MiB; a config is a few KiB")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML: {exc}") from None
    except RecursionError:  # arrays or inline tables nested thousands deep
        raise ConfigError(f"{where} nests values too deeply to be a config") from None


def flatten(prefix: str, table: dict[str, Any], depth: int = 1) -> list[tuple[str, Any]]:
    """Dotted keys of a TOML table; nested tables (TorchTitan's [quantize.linear.float8]) join with dots."""
    if depth > MAX_TABLE_DEPTH:
        raise ConfigError(
            f"TOML table [{shorten(prefix, 60)}] is nested {depth} deep; no key of the config is "
            f"deeper than {MAX_TABLE_DEPTH}"
        )
    out: list[tuple[str, Any]] = []
    for key, value in table.items():
        if isinstance(value, dict):
            out += flatten(f"{prefix}.{key}", value, depth + 1)
        else:
            out.append((f"{prefix}.{key}", value))
    return out
