"""Rerun the documented commands and rewrite every marked region of README.md and docs/*.md.

    python scripts/refresh_docs.py                       # every region (about 10 min on a quiet 2-core machine)
    python scripts/refresh_docs.py --only analysis-tables,short-run
    python scripts/refresh_docs.py --install --suite-log pytest.log   # also the install and test-suite times
    python scripts/refresh_docs.py --check               # markers well-formed and known; which regions are stale
    python scripts/refresh_docs.py --list                # regions, their pages and the commands they run

A figure or console excerpt in the docs lives between ``<!-- refresh:NAME -->`` and
``<!-- /refresh -->`` (scripts/docs_regions.py); the producer NAME (scripts/docs_producers.py) runs
the commands the region shows and writes its text, so a stale number cannot survive a refresh.
Two regions need an input that is too slow for a routine refresh: ``--install`` times a fresh
install into a new virtual environment, ``--suite-log`` reads the duration from the output of a
full ``python -m pytest tests -q``; without them those regions keep their text and are listed.
A failing command leaves its regions untouched and makes the exit code 1; the others are written.
Use OMP_NUM_THREADS=1 when other work shares the cores.

Each rewritten region's marker is stamped with the commit it was made on and a digest of the sources
it describes (scripts/docs_stamps.py); a region whose figures depend on the machine (every one but
the ``check="exact"`` ones) also gets this machine's CPU kind, in its stamp and in a last line its
reader sees (scripts/docs_machine.py). ``--check`` runs nothing: it exits 2 on malformed or unknown
markers or a region whose machine is not said, and 1 when a region's sources (or its producer)
changed since its stamp, naming each such region and the command that refreshes it, and lists the
regions by the kind that made them; CI reruns the cheap deterministic regions and the README tour
instead (tests/unit/test_docs_fresh.py, tests/unit/test_docs_tour.py).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from docs_machine import by_kind, cpu_kind, kind_problems, kind_tag, with_made_line
from docs_producers import PRODUCERS, Context
from docs_regions import ROOT, Region, RegionError, Stamp, all_regions, doc_files, rewrite
from docs_runner import CommandFailed, Runner, duration
from docs_stamps import commit, digest, stale

README_LIMIT = 12 * 1024


def check(root: Path = ROOT) -> list[str]:
    """Problems with the markers: malformed ones, regions no producer knows, producers with no region."""
    try:
        regions = all_regions(root)
    except RegionError as exc:
        return [str(exc)]
    names = {r.name for r in regions}
    problems = [
        f"{r.path}:{r.start + 1}: region '{r.name}' has no producer in scripts/docs_producers.py "
        f"(known: {', '.join(sorted(PRODUCERS))})"
        for r in regions
        if r.name not in PRODUCERS
    ]
    problems += [
        f"producer '{n}' has no region in the docs" for n in sorted(set(PRODUCERS) - names)
    ]
    return problems


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated region names (default: all)")
    parser.add_argument(
        "--install", action="store_true", help="also time a fresh install into a new venv"
    )
    parser.add_argument(
        "--suite-log", type=Path, default=None, help="output of `python -m pytest tests -q`"
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="work folder (default: a new temporary one)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work folder (run outputs, checkpoints)"
    )
    parser.add_argument("--check", action="store_true", help="only check the markers; run nothing")
    parser.add_argument(
        "--list", action="store_true", help="list the regions and their commands; run nothing"
    )
    return parser


def _print_list(regions: list[Region]) -> None:
    """--list: every region, its page, the commands its producer runs and what it describes."""
    for r in regions:
        p = PRODUCERS[r.name]
        print(
            f"{r.name:<20} {r.path}"
            + (f"  (needs --{p.needs.replace('_', '-')})" if p.needs else "")
            + (f"  [CI: {p.check}]" if p.check else "")
            + f"  describes {', '.join(p.sources)}"
        )
        for c in p.commands:
            print("    $ " + c.replace("\n", "\n      "))


def _print_check(regions: list[Region]) -> int:
    """--check: regions whose machine is not said (2), which regions are older than what they
    describe (1 when any, else 0), and the kinds that made them."""
    unsaid = kind_problems(regions, PRODUCERS)
    if unsaid:
        print("refresh_docs: " + "\n  ".join(["regions that do not say their machine:", *unsaid]))
        return 2
    for tag, names in sorted(by_kind(regions).items()):
        print(f"made on {tag}: {', '.join(names)}")
    old = stale(regions, PRODUCERS)
    print(
        f"refresh_docs: {len(regions)} regions in {len(doc_files())} files, all known; "
        + (f"{len(old)} older than the code they describe:" if old else "all fresh")
    )
    for line in old:
        print("  " + line)
    if old:
        names = ",".join(ln.split("region '")[1].split("'")[0] for ln in old)
        print(f"refresh them: OMP_NUM_THREADS=1 python scripts/refresh_docs.py --only {names}")
    return 1 if old else 0


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)

    problems = check()
    if problems:
        print(
            "refresh_docs: " + "\n  ".join(["markers are not in order:", *problems]),
            file=sys.stderr,
        )
        return 2
    regions = all_regions()
    if ns.list:
        _print_list(regions)
        return 0
    if ns.check:
        return _print_check(regions)
    chosen = [r.name for r in regions]
    if ns.only:
        wanted = [n.strip() for n in ns.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in PRODUCERS]
        if unknown:
            print(
                f"refresh_docs: --only {','.join(unknown)}: unknown region (known: {', '.join(chosen)})",
                file=sys.stderr,
            )
            return 2
        chosen = [n for n in chosen if n in wanted]
    if ns.suite_log is not None and not ns.suite_log.is_file():
        print(f"refresh_docs: --suite-log {ns.suite_log}: no such file", file=sys.stderr)
        return 2

    work = ns.work or Path(tempfile.mkdtemp(prefix="refresh_docs-"))
    ctx = Context(
        Runner(work, log=lambda msg: print(msg, flush=True)),
        install=ns.install,
        suite_log=ns.suite_log,
    )
    given = {"install": ns.install, "suite_log": ns.suite_log is not None}
    bodies, kept, failed, t0 = {}, [], [], time.monotonic()
    for i, name in enumerate(chosen, 1):
        needs = PRODUCERS[name].needs
        if needs and not given[needs]:
            kept.append(f"{name} (needs --{needs.replace('_', '-')})")
            continue
        print(f"[{i}/{len(chosen)}] {name} ({duration(time.monotonic() - t0)} so far)", flush=True)
        try:
            bodies[name] = PRODUCERS[name].fn(ctx)
        except (CommandFailed, OSError, ValueError, KeyError, IndexError, StopIteration) as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    kind = cpu_kind()
    stamps: dict[str, Stamp] = {}
    for n in bodies:
        made = (commit(PRODUCERS[n].sources), digest(PRODUCERS[n].sources, PRODUCERS[n].fn))
        if PRODUCERS[n].check != "exact":  # figures of this machine: say which (docs_machine.py)
            bodies[n] = with_made_line(bodies[n], kind)
            made = (*made, kind_tag(kind))
        stamps[n] = made
    for f in doc_files():
        text = f.read_text(encoding="utf-8")
        new = rewrite(text, bodies, str(f.relative_to(ROOT)), stamps)
        if new != text:
            f.write_text(new, encoding="utf-8")
            print(f"rewrote {f.relative_to(ROOT)}")
    if ns.keep:
        print(f"work folder kept: {work}")
    elif ns.work is None:
        shutil.rmtree(work, ignore_errors=True)
    size = (ROOT / "README.md").stat().st_size
    print(
        f"refreshed {len(bodies)} regions in {duration(time.monotonic() - t0)}; README.md is {size:,} bytes"
        + (f" (over the {README_LIMIT:,}-byte front-door limit)" if size > README_LIMIT else "")
    )
    for k in kept:
        print(f"kept: {k}")
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
