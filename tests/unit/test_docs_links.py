"""The docs are self-contained: every relative link in README.md and docs/ resolves to a file (and
anchor) inside the repository, none leaves it, and every spec section the code cites (``§4.4``) has
its numbered heading in docs/ (the spec is docs/loom_spec.md)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/README.md"]
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HREF_RE = re.compile(r"<a\s[^>]*href=\"([^\"]+)\"")
PATH_SPAN_RE = re.compile(r"`(\.\./[^`\s]*)`")  # a path in a code span that starts above its page
ABS_PAGE_RE = re.compile(r"`(/[^`\s]*\.md)`")  # an absolute path to a page, in a code span
FENCE_RE = re.compile(r"^\s*```.*?^\s*```", re.S | re.M)
SECTION_RE = re.compile(r"§\s*(\d+(?:\.\d+)*)")
HEADING_RE = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)[.\s]", re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def _anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # a '#' line in a code block is no heading
    found = {_slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}
    return found | set(re.findall(r"<a\s+id=\"([^\"]+)\"", text))


def _problems(page: Path, root: Path = ROOT) -> list[str]:
    text = FENCE_RE.sub("", page.read_text(encoding="utf-8"))  # code blocks hold no links
    rel = page.relative_to(root)
    prose = re.sub(r"`[^`\n]*`", "", text)
    targets = LINK_RE.findall(prose) + HREF_RE.findall(prose)
    out = []
    for target in targets:
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        if path.startswith(("/", "file:", "~")):
            out.append(
                f"{rel}: link '{target}' is an absolute path (use a path relative to the page)"
            )
            continue
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(root):
            out.append(f"{rel}: link '{target}' leaves the repository")
        elif not dest.exists():
            out.append(f"{rel}: link '{target}' points at nothing ({dest.relative_to(root)})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            out.append(f"{rel}: link '{target}': {dest.relative_to(root)} has no anchor '{anchor}'")
    for span in PATH_SPAN_RE.findall(text):
        if not (page.parent / span).resolve().is_relative_to(root):
            out.append(f"{rel}: `{span}` names a path outside the repository")
    out += [f"{rel}: `{span}` is an absolute path to a page" for span in ABS_PAGE_RE.findall(text)]
    return out


def test_every_link_of_the_docs_resolves_inside_the_repo():
    problems = [p for page in PAGES for p in _problems(page)]
    assert problems == [], "\n".join(problems)


def test_the_link_check_catches_dead_outside_and_absolute_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "plan.md").write_text("# Plan\n\n## The `rooms`, today\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[a](plan.md#the-rooms-today) [b](../../shared/LOOM_SPEC.md) [c](/work/x.md)\n"
        "[d](missing.md) [e](plan.md#no-such-heading) `../../outside/file.md` [ok](../docs/plan.md) "
        "[f](https://example.org/x) [g](plan.md#plan) `/work/shared/SPEC.md`\n"
        "```\nx = w[l](m)\n```\n"
    )
    problems = _problems(page, tmp_path)
    assert len(problems) == 6, problems
    assert "leaves the repository" in problems[0] and "absolute path" in problems[1]
    assert "points at nothing" in problems[2] and "no anchor 'no-such-heading'" in problems[3]
    assert "outside the repository" in problems[4] and "absolute path to a page" in problems[5]


def _headings() -> set[str]:
    return {
        num for page in (ROOT / "docs").glob("*.md") for num in HEADING_RE.findall(page.read_text())
    }


def _cited_sections() -> dict[str, list[str]]:
    """section -> where it is cited, over the package, the tests, the README and the docs."""
    files = [*(ROOT / "torchtitan_loom").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *PAGES]
    cited: dict[str, list[str]] = {}
    for f in files:
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for num in SECTION_RE.findall(line):
                cited.setdefault(num.rstrip("."), []).append(f"{f.relative_to(ROOT)}:{i}")
    return cited


def test_every_cited_spec_section_has_a_numbered_heading_in_docs():
    cited, headings = _cited_sections(), _headings()
    package = [
        s for s, where in cited.items() if any(w.startswith("torchtitan_loom/") for w in where)
    ]
    assert len(package) >= 20  # the package cites the spec by section throughout
    missing = {s: where[:3] for s, where in cited.items() if s not in headings}
    assert missing == {}, f"sections cited but with no heading in docs/: {missing}"
    assert {"4.4", "5.2", "14"} <= headings and "99.9" not in headings


def test_the_house_plan_names_every_module():
    """docs/architecture.md lists the rooms file by file: a module added or renamed without it fails."""
    plan = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", plan))
    modules = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "torchtitan_loom").rglob("*.py")
        if p.name != "__init__.py"
    ]
    assert len(modules) > 50
    missing = [m for m in modules if Path(m).stem not in names]
    assert missing == [], f"docs/architecture.md does not name: {missing}"
