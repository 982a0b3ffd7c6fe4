"""Files the inference tools read that a user or a crash may have damaged: a run's metrics.jsonl
and a Hugging Face tokenizer.json. Each problem is one line naming the file (and the line) and
what is wrong. No torch import: the tools' command lines import this before their slow imports.

metrics.jsonl is optional input (analyze's diagnostics figures, lm_eval's holdout check), so a
bad line there is skipped with one warning line for the whole file (its first bad line, and how
many more), never a traceback: a non-JSON line (e.g. cut by a crash), a line that is not an
object with an integer "step", or a line over MAX_METRICS_LINE bytes (read in bounded pieces,
never held whole).

A run folder whose run.json or metrics.jsonl is there but is no regular file (a FIFO, a link to
/dev/zero) is never opened; ``not_a_run`` says which file and what it is.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torchtitan_loom.components.checkpoint import names

# The --beyond flag of the tools that run a checkpoint to a depth (generate, lm_eval): one text.
BEYOND_HELP = (
    "which router a loop past H uses: last (router H, the default) or cycle (routers 1..H again)"
)

MAX_METRICS_LINE = 8 << 20  # a row with every diagnostic of a large model is a few hundred KiB
MAX_TOKENIZER_JSON = 512 << 20  # the largest HF tokenizer.json files are tens of MiB


class LoadError(ValueError):
    """A checkpoint, tokenizer or pack that cannot be used; the message names it and what is valid."""


class TokenizerFileError(LoadError):
    """A tokenizer.json that exists but cannot be read as a tokenizer (not a missing one)."""


def _open_regular(path: str):
    """A binary file object of the regular file ``path``; a FIFO or device is refused (it would
    block or never end), a link is followed (reading through it writes nothing)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _lines(fh, max_line: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) per line; None for a line longer than ``max_line`` (skipped in
    pieces, so a huge line costs no memory)."""
    number = 0
    while True:
        line = fh.readline(max_line + 1)
        if not line:
            return
        number += 1
        if len(line) > max_line and not line.endswith(b"\n"):
            while (rest := fh.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield number, None
        else:
            yield number, line


def metrics_rows(
    path: str,
    warn: Callable[[str], None] | None = None,
    max_line: int = MAX_METRICS_LINE,
) -> Iterator[dict[str, Any]]:
    """The rows of a metrics.jsonl in order; bad lines are skipped and reported once, through
    ``warn`` (default: one ``warning:`` line on stderr), after the last row."""
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr, flush=True))
    bad: list[tuple[int, str]] = []
    try:
        fh = _open_regular(path)
    except OSError as exc:
        warn(f"{path}: cannot be read ({exc.strerror or exc}); its rows are left out")
        return
    with fh:
        for number, raw in _lines(fh, max_line):
            if raw is None:
                bad.append((number, f"longer than {max_line:,} bytes"))
                continue
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except ValueError as exc:  # JSONDecodeError and undecodable bytes
                bad.append((number, f"not JSON ({str(exc).split(':')[0]})"))
                continue
            if not isinstance(row, dict):
                bad.append((number, f"a JSON {type(row).__name__}, not an object"))
            elif type(row.get("step")) is not int:
                bad.append((number, f'"step" is {row.get("step")!r}, not an integer'))
            else:
                yield row
    if bad:
        (first, why), more = bad[0], len(bad) - 1
        others = f" (and {more} more bad line{'s' * (more > 1)})" if more else ""
        warn(f"{path} line {first}: {why}; skipped{others}")


def check_tokenizer_json(path: str) -> None:
    """TokenizerFileError naming ``path`` when it is not a tokenizer.json the ``tokenizers``
    package could load: not JSON, cut short, or not an object with a "model" object."""
    try:
        with _open_regular(path) as fh:
            data = fh.read(MAX_TOKENIZER_JSON + 1)
    except OSError as exc:
        raise TokenizerFileError(f"tokenizer file {path}: cannot be read ({exc})") from None
    if len(data) > MAX_TOKENIZER_JSON:
        raise TokenizerFileError(
            f"tokenizer file {path}: larger than {MAX_TOKENIZER_JSON:,} bytes; not a tokenizer.json"
        )
    try:
        doc = json.loads(data)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        at_end = isinstance(exc, json.JSONDecodeError) and exc.pos >= len(exc.doc.rstrip()) - 1
        cut = at_end or "Unterminated" in str(exc)
        what = "empty" if not data.strip() else "cut short" if cut else "broken"
        raise TokenizerFileError(
            f"tokenizer file {path}: not valid JSON, {what} ({exc}); replace it with the "
            "tokenizer.json the pack was written with"
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
        found = (
            f"an object with keys {sorted(doc)[:5]}"
            if isinstance(doc, dict)
            else f"a JSON {type(doc).__name__}"
        )
        raise TokenizerFileError(
            f'tokenizer file {path}: {found}, not a tokenizer (an object with a "model" '
            "object); replace it with the tokenizer.json the pack was written with"
        )


def not_a_run(path: str, missing: str) -> str:
    """Why ``path`` is no run folder: one of its run files is there but is no regular file (a FIFO,
    a link to a device: never read), else ``missing`` (the words for files not there)."""
    for name in (names.RUN_JSON, names.METRICS_JSONL):
        file = os.path.join(path, name)
        if os.path.lexists(file) and not os.path.isfile(file):
            kind = file_kind(file)
            if os.path.islink(file):
                kind = f"a symbolic link to {os.readlink(file)!r} ({file_kind(file, follow=True)})"
            return f"its {name} is {kind}, not a regular file"
    return missing


def file_kind(path: str, follow: bool = False) -> str:
    try:
        mode = os.stat(path).st_mode if follow else os.lstat(path).st_mode
    except OSError:
        return "a dangling link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a folder" if stat.S_ISDIR(mode) else "a socket or other special file"
