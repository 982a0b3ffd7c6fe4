"""Which machine made a figure of the docs: the CPU kind a refreshed region names, in its stamp
and in a line its reader sees.

Figures that come from a run (losses, timings, console excerpts) differ between x86-64 CPU kinds
in their low digits (scripts/docs_tour_figures.py says why), so every region that is not
``check="exact"`` ends with a line naming the kind that made it, and its stamp carries the same
kind as a tag, so ``refresh_docs.py --check`` and the tests know it without parsing prose:

    <!-- refresh:short-run made-on 5f21355 kind genuineintel-6-167-avx512-torch-2.13.0-cpu sources ... -->
    ...
    <sub>Made on GenuineIntel family 6 model 167 (Intel(R) Xeon(R) Processor), avx512, torch 2.13.0+cpu.</sub>

A region made before stamps named kinds carries the tag ``unrecorded`` and a line that says so;
only a refresh replaces it (a kind is never written by hand).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from pathlib import Path

UNRECORDED = "unrecorded"
LINE_RE = re.compile(r"^<sub>Made on (?P<kind>.+?)\.</sub>$")
UNRECORDED_LINE = "<sub>Made on a CPU kind not recorded (before refreshes named it).</sub>"


def cpu_kind() -> str:
    """This machine's CPU kind and torch version, as the figures depend on them: vendor, family,
    model and model name, the widest vector extension ATen can use, ATEN_CPU_CAPABILITY when set."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
            if not line.strip():
                break  # the first processor is enough
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse"
    name = re.sub(r"\s+", " ", info.get("model name", platform.processor() or "unknown"))
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    return (
        f"{info.get('vendor_id', platform.machine())} family {info.get('cpu family', '?')} "
        f"model {info.get('model', '?')} ({name}), {isa}"
        + (f", ATEN_CPU_CAPABILITY={capability}" if capability else "")
        + f", torch {importlib.metadata.version('torch')}"
    )


def kind_tag(kind: str) -> str:
    """The stamp's form of a kind: its vendor, family, model, vector extension, capability and
    torch version, lower case, joined by '-' (the model name is left out: the numbers name it)."""
    kept = re.sub(r"\([^()]*(?:\([^()]*\)[^()]*)*\)", " ", kind)  # drop "(Intel(R) Xeon(R) ...)"
    kept = kept.replace("family", " ").replace("model", " ")
    return re.sub(r"[^a-z0-9.]+", "-", kept.lower()).strip("-")


def made_line(kind: str) -> str:
    """The line a region ends with: the kind that made it."""
    return f"<sub>Made on {kind}.</sub>"


def shown_tag(body: str) -> str | None:
    """The kind a region's text names in its last line, as a tag; None when it names none."""
    last = body.rstrip("\n").rsplit("\n", 1)[-1]
    if last == UNRECORDED_LINE:
        return UNRECORDED
    m = LINE_RE.match(last)
    return kind_tag(m["kind"]) if m else None


def without_made_line(body: str) -> str:
    """The region's text without its machine line: what its producer wrote."""
    lines = body.rstrip("\n").split("\n")
    if shown_tag(body) is not None:
        lines = lines[:-1]
        while lines and not lines[-1]:
            lines.pop()
    return "\n".join(lines)


def with_made_line(body: str, kind: str) -> str:
    """The region's text with its machine line (replacing one a producer's text already ends with)."""
    return without_made_line(body) + "\n\n" + made_line(kind)


def kind_problems(regions: list, producers: dict) -> list[str]:
    """One line per region whose machine is not said as above: a region whose figures depend on the
    machine without a kind in its stamp, or whose last line names another kind (or none); a
    deterministic (``check="exact"``) region that carries a kind."""
    out = []
    for r in regions:
        where = f"{r.path}:{r.start + 1}: region '{r.name}'"
        if producers[r.name].check == "exact":
            if r.kind is not None:
                out.append(f"{where} is deterministic but its stamp names a kind ({r.kind})")
        elif r.kind is None:
            out.append(f"{where} carries no kind in its stamp (refresh it)")
        elif shown_tag(r.body) != r.kind:
            out.append(
                f"{where}: its stamp says kind {r.kind}, its last line "
                + (f"says {shown_tag(r.body)}" if shown_tag(r.body) else "names no kind")
            )
    return out


def by_kind(regions: list) -> dict[str, list[str]]:
    """The regions' names by the kind tag their stamps carry (regions without one left out)."""
    out: dict[str, list[str]] = {}
    for r in regions:
        if r.kind is not None:
            out.setdefault(r.kind, []).append(r.name)
    return out
