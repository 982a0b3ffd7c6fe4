"""The marked regions of the docs that scripts/refresh_docs.py rewrites.

A region is a block of lines between an opening and a closing marker, each alone on its line:

    <!-- refresh:NAME -->
    ... text written by the producer NAME ...
    <!-- /refresh -->

The markers may be indented (a region inside a list item); the producer's text is written with the
opening marker's indentation. Regions do not nest, and a name appears once across all the docs, so
every figure has one producer and one place.

A refresh stamps the opening marker with what the text was made from:

    <!-- refresh:NAME made-on 5f21355 kind genuineintel-6-167-avx512-torch-2.13.0-cpu sources 3a9c1e2b7d40 -->

``made-on`` is the commit the refresh ran on (``+``: with uncommitted changes to the region's
sources), ``kind`` the CPU kind that made a region whose figures depend on it (scripts/docs_machine.py;
absent on the deterministic ``check="exact"`` regions), ``sources`` a digest of the files the region
describes and of its producer (scripts/docs_stamps.py); ``refresh_docs.py --check`` names the regions
whose sources changed since, and the kind each was made on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPEN_RE = re.compile(
    r"^(?P<indent>[ \t]*)<!-- refresh:(?P<name>[a-z0-9][a-z0-9-]*)"
    r"(?: made-on (?P<commit>[0-9a-f]+\+?|unknown)(?: kind (?P<kind>[a-z0-9.-]+))?"
    r" sources (?P<sources>[0-9a-f]+))? -->[ \t]*$"
)
CLOSE_RE = re.compile(r"^[ \t]*<!-- /refresh -->[ \t]*$")
ANY_MARKER_RE = re.compile(r"<!-- */? *refresh")


class RegionError(ValueError):
    """A malformed marker: the message names the file and line."""


@dataclass(frozen=True)
class Region:
    path: str
    name: str
    indent: str
    start: int  # index of the opening marker's line
    end: int  # index of the closing marker's line
    body: str  # the text between the markers, indentation removed
    commit: str | None = None  # the stamp: commit the text was made on ('+': sources were edited)
    sources: str | None = None  # the stamp: digest of the sources and producer it was made from
    kind: str | None = (
        None  # the stamp: the CPU kind's tag (scripts/docs_machine.py), if it has one
    )


def doc_files(root: Path = ROOT) -> list[Path]:
    """The files whose regions are refreshed: the README and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def parse(text: str, path: str = "<text>") -> list[Region]:
    lines = text.split("\n")
    regions: list[Region] = []
    open_at: int | None = None
    for i, line in enumerate(lines):
        m_open, m_close = OPEN_RE.match(line), CLOSE_RE.match(line)
        if not (m_open or m_close):
            if ANY_MARKER_RE.search(line):
                raise RegionError(
                    f"{path}:{i + 1}: not a well-formed refresh marker (a marker is alone on its "
                    f"line: '<!-- refresh:NAME -->' or '<!-- /refresh -->'): {line.strip()}"
                )
            continue
        if m_open:
            if open_at is not None:
                raise RegionError(
                    f"{path}:{i + 1}: region '{m_open['name']}' opens inside region "
                    f"'{OPEN_RE.match(lines[open_at])['name']}' (line {open_at + 1}); regions do not nest"
                )
            open_at = i
            continue
        if open_at is None:
            raise RegionError(f"{path}:{i + 1}: '<!-- /refresh -->' without an opening marker")
        m = OPEN_RE.match(lines[open_at])
        indent = m["indent"]
        body = "\n".join(_dedent(ln, indent) for ln in lines[open_at + 1 : i])
        regions.append(
            Region(path, m["name"], indent, open_at, i, body, m["commit"], m["sources"], m["kind"])
        )
        open_at = None
    if open_at is not None:
        raise RegionError(
            f"{path}:{open_at + 1}: region '{OPEN_RE.match(lines[open_at])['name']}' is never closed"
        )
    return regions


def _dedent(line: str, indent: str) -> str:
    return line[len(indent) :] if line.startswith(indent) else line.lstrip(" \t")


Stamp = tuple[str, str] | tuple[str, str, str]  # (commit, sources digest[, kind tag])


def marker(name: str, indent: str = "", stamp: Stamp | None = None) -> str:
    """The opening marker of region `name`, with the stamp (commit, sources digest and, for a
    region whose figures depend on the machine, the kind tag) when given."""
    if not stamp:
        return f"{indent}<!-- refresh:{name} -->"
    kind = f" kind {stamp[2]}" if len(stamp) == 3 else ""
    return f"{indent}<!-- refresh:{name} made-on {stamp[0]}{kind} sources {stamp[1]} -->"


def rewrite(
    text: str,
    new_bodies: dict[str, str],
    path: str = "<text>",
    stamps: dict[str, Stamp] | None = None,
) -> str:
    """The text with the body of every region named in new_bodies replaced (and its marker stamped
    when `stamps` names it); other regions are kept as they are."""
    lines = text.split("\n")
    for region in reversed(parse(text, path)):
        if region.name not in new_bodies:
            continue
        body = new_bodies[region.name].strip("\n").split("\n")
        lines[region.start + 1 : region.end] = [(region.indent + ln) if ln else "" for ln in body]
        if stamps and region.name in stamps:
            lines[region.start] = marker(region.name, region.indent, stamps[region.name])
    return "\n".join(lines)


def all_regions(root: Path = ROOT) -> list[Region]:
    """Every region of the docs; a name used twice is an error."""
    regions, seen = [], {}
    for f in doc_files(root):
        for region in parse(f.read_text(encoding="utf-8"), str(f.relative_to(root))):
            if region.name in seen:
                raise RegionError(
                    f"{region.path}:{region.start + 1}: region '{region.name}' is also in "
                    f"{seen[region.name]}; a region name appears once"
                )
            seen[region.name] = region.path
            regions.append(region)
    return regions


def displayed_commands(body: str) -> list[str]:
    """The commands a region shows: lines starting with '$ ', with their continuation lines (a trailing
    backslash, or an open double quote)."""
    out, lines, i = [], body.split("\n"), 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            i += 1
            continue
        cmd = lines[i][2:]
        while (cmd.endswith("\\") or cmd.count('"') % 2) and i + 1 < len(lines):
            i += 1
            cmd += "\n" + lines[i]
        out.append(cmd)
        i += 1
    return out
