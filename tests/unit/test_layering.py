"""The package's layering, checked on the source: every import (lazy ones inside functions included)
points down the layers tools → train → config → components → models → distributed → protocols (with
the data contract),
no module imports itself back through others (no cycle), and no file outside models/loom/ names a
LOOM field (the trainer and its components reach a model only through protocols.py and its TrainSpec).
"""

import ast
import dataclasses
import io
import tokenize
from pathlib import Path

import torchtitan_loom
from torchtitan_loom.models.loom.looping_residual import LoopCarry
from torchtitan_loom.protocols import get_train_spec

PKG = Path(torchtitan_loom.__file__).parent
# Top to bottom; a module may import its own layer and the ones below it.
LAYERS = (
    ("tools",),
    ("train", "launch"),
    ("config",),
    ("components",),
    ("models",),
    ("distributed",),
    ("protocols", "data_contract"),
)


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Package modules imported anywhere in the file (``from a import b`` counts a.b when a module)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("torchtitan_loom")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("torchtitan_loom"):
                continue
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
            found |= subs or {base}
    return {m for m in found if m in known and m != name}


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else None
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, name, known) for name, path in known.items()}


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in modules() if m != "torchtitan_loom" and layer_of(m) is None)
    assert unplaced == [], f"modules outside the layers {LAYERS}: {unplaced}"


def test_imports_point_down_the_layers():
    upward = sorted(
        f"{a} imports {b}"
        for a, deps in graph().items()
        for b in deps
        if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) < layer_of(a)
    )
    assert upward == [], "\n".join(upward)


def test_no_import_cycle():
    g = graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert cycles == [], f"import cycles: {cycles}"


def test_the_checker_sees_lazy_imports_and_cycles(tmp_path):
    # The checker itself: a lazy import inside a function is an edge, and a cycle through it is found.
    known = {
        "torchtitan_loom.tools.a": tmp_path / "a.py",
        "torchtitan_loom.tools.b": tmp_path / "b.py",
    }
    known["torchtitan_loom.tools.a"].write_text(
        "def f():\n    from torchtitan_loom.tools.b import g\n"
    )
    known["torchtitan_loom.tools.b"].write_text("from torchtitan_loom.tools import a\n")
    assert imports(known["torchtitan_loom.tools.a"], "torchtitan_loom.tools.a", known) == {
        "torchtitan_loom.tools.b"
    }
    assert imports(known["torchtitan_loom.tools.b"], "torchtitan_loom.tools.b", known) == {
        "torchtitan_loom.tools.a"
    }


# Names a LOOM file defines that mean something else elsewhere: torch's reduction keyword `dim=`,
# and the sampler's own top-k option (SamplingConfig.top_k, tools/generate.py --top-k).
OTHER_MEANINGS = {
    "dim": "keyword",
    "top_k": {"components/evaluation/sampling.py", "tools/generate.py"},
}


def loom_fields() -> set[str]:
    """The LOOM args' fields beyond the protocol's generic ones, and the fields of its carry."""
    args = next(iter(get_train_spec("loom").model_args.values()))
    generic = {"vocab_size", "init_seed", "max_seq_len", "num_loops"}
    return {f.name for f in dataclasses.fields(args)} - generic | set(LoopCarry._fields)


def field_uses(source: str, fields: set[str], rel: str) -> list[str]:
    """``.field`` (not a method call), ``field=`` in a call, or the string ``"field"``."""
    toks = [
        t
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type
        not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
    ]
    hits = []
    for i, t in enumerate(toks):
        prev = toks[i - 1].string if i else ""
        nxt = toks[i + 1].string if i + 1 < len(toks) else ""
        other = OTHER_MEANINGS.get(t.string)
        if (
            t.type == tokenize.NAME
            and t.string in fields
            and not (isinstance(other, set) and rel in other)
        ):
            if prev == "." and nxt != "(":
                hits.append(f"{rel}:{t.start[0]}: .{t.string}")
            elif nxt == "=" and prev in ("(", ",") and other != "keyword":
                hits.append(f"{rel}:{t.start[0]}: {t.string}=")
        elif t.type == tokenize.STRING and t.string.strip("'\"") in fields:
            hits.append(f"{rel}:{t.start[0]}: {t.string}")
    return hits


def test_no_loom_field_outside_models_loom():
    fields = loom_fields()
    assert {"num_routed_experts", "attn_backend", "z_BSD"} <= fields
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if not rel.startswith("models/loom/"):
            hits += field_uses(path.read_text(), fields, rel)
    assert hits == [], "\n".join(hits)


def test_the_field_grep_finds_what_it_looks_for():
    fields = loom_fields()
    src = 'n = model.args.num_routed_experts\nargs.replace(capacity_factor=0)\ngetattr(a, "attn_backend")\nx.dim()\n'
    assert len(field_uses(src, fields, "x.py")) == 3
