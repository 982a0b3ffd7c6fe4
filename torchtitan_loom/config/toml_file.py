"""Reading a config file: a bounded, non-blocking read of a regular file, parsed as TOML, and its
tables flattened to dotted keys. Every problem is a one-line ConfigError naming the file."""

from __future__ import annotations

import os
import re
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
# Bounds checked on the text before the parser sees it: tomllib's memory grows with the square of a
# dotted key's parts (50,000 parts: over 3 GB), and every [table] costs it a dict. A config's
# longest key is ~40 characters, its deepest 4 parts, its tables ~25.
MAX_KEY_CHARS = 256
MAX_KEY_PARTS = 16
MAX_TABLES = 256
# The parts of TOML that can hold a '.', '=', '[' or ',' that is not syntax: strings and comments,
# matched whole (so their insides are skipped), and the syntax characters the bounds count.
_TOKEN = re.compile(
    r'"""(?:[^"\\]|\\[\s\S]|"(?!""))*"""|\'\'\'[\s\S]*?\'\'\'|"(?:[^"\\\n]|\\.)*"'
    r"|'[^'\n]*'|#[^\n]*|[.=,{}\[\]\n]"
)


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
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    check_shape(text, where)
    try:
        parsed = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML: {exc}") from None
    except RecursionError:  # arrays or inline tables nested thousands deep
        raise ConfigError(f"{where} nests values too deeply to be a config") from None
    deep = _too_deep(parsed, "", 0)
    if deep:
        raise ConfigError(
            f"{where}: TOML table [{shorten(deep, 60)}] is nested {MAX_TABLE_DEPTH + 1} deep; no "
            f"key of the config is deeper than {MAX_TABLE_DEPTH}"
        )
    return parsed


def _too_deep(table: dict[str, Any], prefix: str, depth: int) -> str:
    """The dotted name of a table nested deeper than MAX_TABLE_DEPTH in ``table`` (at ``depth``),
    else ''; recursion stops there, so a deep file costs no more than a shallow one."""
    for key, value in table.items():
        if isinstance(value, dict):
            name = f"{prefix}.{key}" if prefix else key
            if depth + 1 > MAX_TABLE_DEPTH:
                return name
            deep = _too_deep(value, name, depth + 1)
            if deep:
                return deep
    return ""


def check_shape(text: str, where: str) -> None:
    """ConfigError (one line naming the file) when a key of ``text`` is longer than MAX_KEY_CHARS or
    has more than MAX_KEY_PARTS dotted parts, or ``text`` opens more than MAX_TABLES [tables]: a
    linear scan, so a file made to exhaust the parser is refused before it runs. Outside strings and
    comments, a '.' joins key parts (a number or a time has at most one); a key ends at '='."""
    dots, start, depth, tables, line_start = 0, 0, 0, 0, True
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if tok == ".":
            dots += 1
            if dots >= MAX_KEY_PARTS:
                line = text.count("\n", 0, m.start()) + 1
                raise ConfigError(
                    f"{where} line {line}: a key of over {MAX_KEY_PARTS} dotted parts; no key of "
                    f"the config has more than {MAX_TABLE_DEPTH}"
                )
            continue
        chars = len(text[start : m.start()].strip()) if m.start() - start > MAX_KEY_CHARS else 0
        if tok == "=" and chars > MAX_KEY_CHARS:
            line = text.count("\n", 0, m.start()) + 1
            raise ConfigError(
                f"{where} line {line}: a key of {chars:,} characters; a key of the config has at "
                f"most {MAX_KEY_CHARS}"
            )
        if tok == "[" and depth == 0 and line_start:
            tables += 1
            if tables > MAX_TABLES:
                raise ConfigError(
                    f"{where} opens over {MAX_TABLES} [tables]; a config has one per section"
                )
        if tok in "=,{}[]\n":  # a new key or value starts after each of these
            depth += {"[": 1, "]": -1}.get(tok, 0)
            dots, start = 0, m.end()
            line_start = tok == "\n" or (line_start and tok == "[")


def flatten(prefix: str, table: dict[str, Any], depth: int = 1) -> list[tuple[str, Any]]:
    """Dotted keys of a TOML table; nested tables (TorchTitan's [quantize.linear.float8]) join with
    dots. An empty nested table is kept as a key whose value is {}: the schema checks its name."""
    if depth > MAX_TABLE_DEPTH:
        raise ConfigError(
            f"TOML table [{shorten(prefix, 60)}] is nested {depth} deep; no key of the config is "
            f"deeper than {MAX_TABLE_DEPTH}"
        )
    out: list[tuple[str, Any]] = []
    for key, value in table.items():
        if isinstance(value, dict) and value:
            out += flatten(f"{prefix}.{key}", value, depth + 1)
        else:
            out.append((f"{prefix}.{key}", value))
    return out
