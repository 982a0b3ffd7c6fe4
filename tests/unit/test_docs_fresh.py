"""The docs' cheap, deterministic regions are what their producers write from this tree, and
scripts/refresh_docs.py --check names a region whose sources changed since it was made.

The regions marked ``check="exact"`` in scripts/docs_producers.py (the presets' sizes, the dry run
and its estimates, the figures the estimate and cost model give, the protocol's surface) involve no
training and no timing, so CI reruns their producers (a few dry runs, about a minute) and compares
the text; a change to the code they describe fails here until
``python scripts/refresh_docs.py --only NAME`` is rerun. The slow and timed regions carry a stamp
instead (scripts/docs_stamps.py), checked by the stamp tests below.
"""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from docs_producers import PRODUCERS, Context, Producer  # noqa: E402
from docs_regions import all_regions, doc_files, marker, parse, rewrite  # noqa: E402
from docs_runner import Runner  # noqa: E402
from docs_stamps import digest, stale  # noqa: E402

EXACT = sorted(n for n, p in PRODUCERS.items() if p.check == "exact")


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """One context for every exact producer, so runs they share (the estimate's facts) run once."""
    return Context(Runner(tmp_path_factory.mktemp("docs_fresh"), log=lambda msg: None))


def test_the_cheap_regions_are_checked():
    assert {"dry-run-estimates", "fsdp-sync-volume", "protocol-surface", "preset-sizes"} <= set(
        EXACT
    )
    assert PRODUCERS["default-run-console"].check == "figures"  # tests/unit/test_docs_tour.py


@pytest.mark.parametrize("name", EXACT)
def test_region_is_what_its_producer_writes_now(name, ctx):
    region = next(r for r in all_regions() if r.name == name)
    now = PRODUCERS[name].fn(ctx).strip("\n")
    assert region.body == now, (
        f"{region.path}: region '{name}' is stale; refresh it with "
        f"OMP_NUM_THREADS=1 python scripts/refresh_docs.py --only {name}"
    )


def _producer(fn, sources=("pkg",)) -> Producer:
    return Producer((), fn, sources=sources)


def _made(ctx) -> str:
    return "text"


def test_a_stamp_goes_stale_when_a_source_or_the_producer_changes(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.pyc").write_bytes(b"\0")
    producers = {"r": _producer(_made), "s": _producer(_made)}
    page = tmp_path / "README.md"
    page.write_text(
        f"{marker('r')}\nold\n<!-- /refresh -->\n{marker('s')}\nold\n<!-- /refresh -->\n"
    )
    regions = parse(page.read_text(), "README.md")
    assert [ln.split(": ")[1] for ln in stale(regions, producers, tmp_path)] == [
        "region 'r' carries no stamp (never refreshed)",
        "region 's' carries no stamp (never refreshed)",
    ]
    stamp = ("abc1234", digest(("pkg",), _made, tmp_path))
    page.write_text(
        rewrite(page.read_text(), {"r": "new", "s": "new"}, stamps={"r": stamp, "s": stamp})
    )
    regions = parse(page.read_text(), "README.md")
    assert [(r.commit, r.sources, r.body) for r in regions] == [(*stamp, "new")] * 2
    assert stale(regions, producers, tmp_path) == []

    (tmp_path / "pkg" / "__pycache__" / "a.pyc").write_bytes(b"\1")  # caches do not count
    assert stale(regions, producers, tmp_path) == []
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")  # an edit, committed or not
    assert len(stale(regions, producers, tmp_path)) == 2
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    assert stale(regions, producers, tmp_path) == []

    def _made_otherwise(ctx) -> str:
        return "other text"

    producers["s"] = _producer(_made_otherwise)  # the producer itself changed
    (line,) = stale(regions, producers, tmp_path)
    assert "region 's' was made on abc1234" in line and "(pkg)" in line


def test_every_producer_names_sources_that_exist():
    for name, p in PRODUCERS.items():
        assert p.sources, name
        assert digest(p.sources, p.fn)  # raises FileNotFoundError naming a missing path


DATE_RE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def _dates_outside_regions(text: str) -> list[int]:
    inside = {i for r in parse(text) for i in range(r.start, r.end + 1)}
    return [
        i + 1 for i, ln in enumerate(text.split("\n")) if DATE_RE.search(ln) and i not in inside
    ]


def test_no_date_outside_a_region():
    """A date says when a figure was measured, so it lives in the region its producer rewrites."""
    found = {
        str(f.relative_to(ROOT)): lines
        for f in doc_files()
        if (lines := _dates_outside_regions(f.read_text(encoding="utf-8")))
    }
    assert found == {}, f"dates outside a refresh region (page: lines): {found}"
    probe = "measured 2026-12-01\n<!-- refresh:x -->\non 2026-12-02\n<!-- /refresh -->\n"
    assert _dates_outside_regions(probe) == [1]
