"""One meaning per name (issue 44): in the package, "layout" is the parallel layout (the degrees a
launch lays the model out with, parallelism.layout). The checkpoint folder's module is
checkpoint/tree.py, a data epoch's rows a RowPlan, the float8 kernel's padded rows `pad_rows`, the
model's observed branches `observed_branches`. An identifier containing "layout" is either one of
the parallel layout's names below or a name that is not ours, each with its reason; a new one fails
here until it is renamed or declared."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "torchtitan_loom"

PARALLEL_LAYOUT = {
    "layout",  # parallelism.layout and a layout of degrees (config, validate)
    "LAYOUTS",  # its choices
    "_auto_layout",
    "_log_layout",
    "candidate_layouts",
    "rank_layouts",
    "layout_name",
    "layout_errors",
    "layout_errors_fn",
}
NOT_OURS = {
    "LAYOUT_MD": "the file LAYOUT.md every checkpoint folder holds (on-disk name, kept)",
    "_LAYOUT": "the pack format's meta.json 'layout' field (on-disk, the reference packer's)",
    "tight_layout": "matplotlib's Figure method",
}
# Where the name `layout` is not ours: torch's tensor attribute, matplotlib's keyword argument.
FOREIGN_LAYOUT = {
    "components/checkpoint/safe_read.py": "torch.layout, a type a checkpoint may hold",
    "tools/analyze_diag.py": "matplotlib Figure(layout=...)",
    "tools/compare_report.py": "matplotlib Figure(layout=...)",
}


def _names(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.keyword) and n.arg:
            out.add(n.arg)
    return {x for x in out if "layout" in x.lower()}


def layout_names() -> dict[str, set[str]]:
    return {
        str(f.relative_to(PKG)): names
        for f in sorted(PKG.rglob("*.py"))
        if (names := _names(ast.parse(f.read_text())))
    }


def test_layout_means_the_parallel_layout():
    strays = {
        f: sorted(n for n in names if n not in PARALLEL_LAYOUT and n not in NOT_OURS)
        for f, names in layout_names().items()
    }
    assert {f: n for f, n in strays.items() if n} == {}


def test_the_bare_name_layout_is_the_parallel_layout_or_not_ours():
    users = {f for f, names in layout_names().items() if "layout" in names}
    parallel = {f for f in users if f.startswith(("config/", "distributed/"))}
    assert users - parallel == set(FOREIGN_LAYOUT), users - parallel


def test_the_scan_finds_a_new_meaning():
    tree = ast.parse("def padded_layout(counts):\n    return counts\nx = obj.row_layout\n")
    assert _names(tree) == {"padded_layout", "row_layout"}
