"""Values echoed in messages, kept readable: the one helper every error line uses for a value it
repeats back (a path, a config value, a library's message), so a 50 MB ``data.path`` gives a line
of a few hundred characters that still names its start, its end and its length."""

from __future__ import annotations

import re
from typing import Any

LIMIT = 200  # characters of an echoed value


def shorten(value: Any, limit: int = LIMIT) -> str:
    """``str(value)``, or for a longer one its head and tail around ``… (N chars) …``."""
    text = str(value)
    if len(text) <= limit:
        return text
    keep = max(limit - 24, 8)
    head, tail = text[: keep * 2 // 3], text[-(keep - keep * 2 // 3) :]
    return f"{head}… ({len(text)} chars) …{tail}"


# Terminal control characters (ESC, BEL, CR, NUL, DEL, C1): a path or value echoed raw could move the
# cursor, recolour or clear the user's terminal; each is shown as its escape instead.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_QUOTED = re.compile(rf"'[^'\n]{{{LIMIT},}}'|\"[^\"\n]{{{LIMIT},}}\"")
_LONG_RUN = re.compile(rf"\S{{{LIMIT + 1},}}")


def printable(text: str) -> str:
    """``text`` with every control character (a newline too) written as its escape (``\\x1b``)."""
    return _CONTROL.sub(lambda m: repr(m.group(0))[1:-1], text)


def shorten_line(line: str) -> str:
    """An error line with every long echoed value shortened (``shorten``): a quoted value as a
    whole, then any run without spaces (an unquoted path, a library's repr). Words stay as they
    are; control characters are escaped (``printable``)."""
    line = printable(line)
    line = _QUOTED.sub(lambda m: m.group(0)[0] + shorten(m.group(0)[1:-1]) + m.group(0)[0], line)
    return _LONG_RUN.sub(lambda m: shorten(m.group(0)), line)


def count(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun in the number it needs: ``1 rank``, ``2 ranks``, ``3 batches`` (-es after
    s, x, ch, sh unless ``many`` says otherwise)."""
    if many is None:
        many = one + ("es" if one.endswith(("s", "x", "ch", "sh")) else "s")
    return f"{n:,} {one if n == 1 else many}"
