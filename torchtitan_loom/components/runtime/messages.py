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


_QUOTED = re.compile(r"'[^'\n]{%d,}'|\"[^\"\n]{%d,}\"" % (LIMIT, LIMIT))
_LONG_RUN = re.compile(r"\S{%d,}" % (LIMIT + 1))


def shorten_line(line: str) -> str:
    """An error line with every long echoed value shortened (``shorten``): a quoted value as a
    whole, then any run without spaces (an unquoted path, a library's repr). Words stay as they are."""
    line = _QUOTED.sub(lambda m: m.group(0)[0] + shorten(m.group(0)[1:-1]) + m.group(0)[0], line)
    return _LONG_RUN.sub(lambda m: shorten(m.group(0)), line)
