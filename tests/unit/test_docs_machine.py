"""Every figure of the docs says the CPU kind that made it (scripts/docs_machine.py): a region whose
figures depend on the machine carries the kind's tag in its stamp and names the kind in its last
line, the two agree, and a deterministic region names none; refresh_docs.py --check refuses a
region that does not say its machine and lists the regions by kind."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import refresh_docs  # noqa: E402
from docs_context import Producer  # noqa: E402
from docs_machine import (  # noqa: E402
    UNRECORDED,
    UNRECORDED_LINE,
    cpu_kind,
    kind_problems,
    kind_tag,
    made_line,
    shown_tag,
    with_made_line,
)
from docs_producers import PRODUCERS  # noqa: E402
from docs_regions import all_regions, marker, parse  # noqa: E402

INTEL = "GenuineIntel family 6 model 167 (Intel(R) Xeon(R) Processor), avx512, torch 2.13.0+cpu"
ZEN4 = "AuthenticAMD family 25 model 17 (AMD EPYC), avx512, torch 2.13.0+cpu"


def test_every_region_of_the_docs_says_its_machine():
    regions = all_regions()
    assert kind_problems(regions, PRODUCERS) == []
    timed = [r for r in regions if PRODUCERS[r.name].check != "exact"]
    assert len(timed) >= 15 and all(r.kind for r in timed)
    # docs/after_training.md's examples were made on a named kind (issue 45), not an unrecorded one.
    after = [r for r in regions if r.path == "docs/after_training.md"]
    assert after and all(r.kind != UNRECORDED for r in after), [(r.name, r.kind) for r in after]


def test_a_kind_has_one_tag_that_names_vendor_family_model_isa_and_torch():
    assert kind_tag(INTEL) == "genuineintel-6-167-avx512-torch-2.13.0-cpu"
    assert kind_tag(ZEN4) == "authenticamd-25-17-avx512-torch-2.13.0-cpu"
    capped = INTEL.replace(", torch", ", ATEN_CPU_CAPABILITY=avx2, torch")
    assert kind_tag(capped) == "genuineintel-6-167-avx512-aten-cpu-capability-avx2-torch-2.13.0-cpu"
    assert kind_tag(cpu_kind()) == shown_tag(made_line(cpu_kind()))  # this machine's round trip


def test_the_machine_line_is_added_once_and_a_refresh_replaces_it():
    once = with_made_line("```\n$ run\n```\n", INTEL)
    assert once == "```\n$ run\n```\n\n" + made_line(INTEL)
    assert with_made_line(once, ZEN4) == "```\n$ run\n```\n\n" + made_line(ZEN4)
    assert with_made_line("text\n\n" + UNRECORDED_LINE, INTEL) == "text\n\n" + made_line(INTEL)
    assert shown_tag("a made-on line elsewhere: <sub>Made on X.</sub>\nlast") is None


def _regions(text: str):
    return parse(text, "README.md")


def test_check_names_a_region_that_does_not_say_its_machine(tmp_path, monkeypatch, capsys):
    producers = {
        "t": Producer((), lambda ctx: "", check=None),
        "e": Producer((), lambda ctx: "", check="exact"),
    }
    tag = kind_tag(INTEL)
    good = (
        f"{marker('t', '', ('abc1234', '0' * 12, tag))}\nfigures\n\n{made_line(INTEL)}\n<!-- /refresh -->\n"
        f"{marker('e', '', ('abc1234', '0' * 12))}\nexact\n<!-- /refresh -->\n"
    )
    assert kind_problems(_regions(good), producers) == []
    other = good.replace(made_line(INTEL), made_line(ZEN4))
    unstamped = good.replace(f" kind {tag}", "")
    exact_kind = good.replace("made-on abc1234 sources", f"made-on abc1234 kind {tag} sources")
    no_line = good.replace(f"\n\n{made_line(INTEL)}", "")
    problems = {
        name: kind_problems(_regions(text), producers)
        for name, text in (
            ("other", other),
            ("unstamped", unstamped),
            ("exact", exact_kind),
            ("none", no_line),
        )
    }
    assert problems["other"] == [
        f"README.md:1: region 't': its stamp says kind {tag}, its last line says {kind_tag(ZEN4)}"
    ]
    assert problems["unstamped"] == [
        "README.md:1: region 't' carries no kind in its stamp (refresh it)"
    ]
    assert problems["exact"] == [
        f"README.md:6: region 'e' is deterministic but its stamp names a kind ({tag})"
    ]
    assert problems["none"] == [
        f"README.md:1: region 't': its stamp says kind {tag}, its last line names no kind"
    ]
    # The command: exit 2 and the region named, on the real tree with one region's line removed.
    regions = all_regions()
    broken = next(r for r in regions if r.kind and r.kind != UNRECORDED)
    cut = [r if r is not broken else r.__class__(**{**r.__dict__, "body": "x"}) for r in regions]
    monkeypatch.setattr(refresh_docs, "all_regions", lambda root=None: cut)
    assert refresh_docs.main(["--check"]) == 2
    assert f"region '{broken.name}'" in capsys.readouterr().out


def test_check_lists_the_regions_by_the_kind_that_made_them(capsys):
    refresh_docs.main(["--check"])
    out = capsys.readouterr().out
    for r in all_regions():
        if r.kind:
            line = next(ln for ln in out.splitlines() if ln.startswith(f"made on {r.kind}: "))
            assert r.name in line.split(": ", 1)[1].split(", ")
    assert UNRECORDED_LINE.startswith("<sub>Made on a CPU kind not recorded")
