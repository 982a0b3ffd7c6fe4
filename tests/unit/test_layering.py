"""The package's layering, checked on the source: every import (lazy ones inside functions and string
imports through importlib included) points down the layers tools → the trainer (train.py, trainer/,
launch.py) → config → components → models → distributed → protocols (with the data contract);
components/ never imports a model (it reaches one only through protocols.py); LOOM's math never
imports its infra and the infra never imports the models.loom package back; no module imports
itself back through others (no cycle); and no file outside models/loom/ names a LOOM field,
attribute or method that the protocols do not declare (the args' fields, the carry's, and
everything the LOOM modules define on their classes and instances, collected from a built model).
"""

import ast
import dataclasses
import io
import tokenize
from pathlib import Path

import torch
from torch import nn

import torchtitan_loom
from torchtitan_loom import protocols
from torchtitan_loom.models.loom.looping_residual import LoopCarry
from torchtitan_loom.protocols import get_train_spec

PKG = Path(torchtitan_loom.__file__).parent
# Top to bottom; a module may import its own layer and the ones below it.
LAYERS = (
    ("tools",),
    ("train", "trainer", "launch"),
    ("config",),
    ("components",),
    ("models",),
    ("distributed",),
    ("protocols", "model_cost", "data_contract", "depth_sampling", "loop_request"),
)


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


# The one upward edge by design: the TrainSpec registry imports the bundled model packages by name
# on the first lookup (plugin discovery), so nothing below the models has to name them.
REGISTRY_LOADS = {("torchtitan_loom.protocols", "torchtitan_loom.models")}


def _string_module(value: str, known: dict[str, Path]) -> str | None:
    """The package module a dotted string names (``importlib.import_module("torchtitan_loom.x")``,
    ``__import__``, a module-name constant): the longest known prefix of it, or None."""
    parts = value.split(".")
    if parts[0] != "torchtitan_loom" or not all(p.isidentifier() for p in parts):
        return None
    return next(
        (m for m in (".".join(parts[:n]) for n in range(len(parts), 1, -1)) if m in known), None
    )


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Package modules imported anywhere in the file (``from a import b`` counts a.b when a module),
    string imports included (any string constant naming a package module)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found |= {m for m in [_string_module(node.value, known)] if m}
        elif isinstance(node, ast.Import):
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
    """module -> the package modules it imports; the registry's lazy load of the models (called at
    the first lookup, never at import) is not an edge, so it neither breaks the layers nor a cycle."""
    known = modules()
    return {
        name: {b for b in imports(path, name, known) if (name, b) not in REGISTRY_LOADS}
        for name, path in known.items()
    }


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in modules() if m != "torchtitan_loom" and layer_of(m) is None)
    assert unplaced == [], f"modules outside the layers {LAYERS}: {unplaced}"


def test_the_registry_load_is_the_one_string_import_upward():
    known = modules()
    path = known["torchtitan_loom.protocols"]
    assert "torchtitan_loom.models" in imports(path, "torchtitan_loom.protocols", known)


def test_imports_point_down_the_layers():
    upward = sorted(
        f"{a} imports {b}"
        for a, deps in graph().items()
        for b in deps
        if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) < layer_of(a)
    )
    assert upward == [], "\n".join(upward)


def test_components_reach_a_model_only_through_protocols():
    touching = sorted(
        f"{a} imports {b}"
        for a, deps in graph().items()
        if a.startswith("torchtitan_loom.components")
        for b in deps
        if b.startswith("torchtitan_loom.models")
    )
    assert touching == [], "\n".join(touching)


def test_loom_math_and_its_infra_do_not_import_each_other_back():
    # The package's __init__ registers the spec and may import both; the math modules never import
    # the infra, and the infra imports math modules, never the models.loom package itself.
    loom, infra = "torchtitan_loom.models.loom", "torchtitan_loom.models.loom.infra"
    bad = []
    for a, deps in graph().items():
        if a.startswith(loom + ".") and not a.startswith(infra):
            bad += [f"{a} imports {b}" for b in deps if b.startswith(infra)]
        if a.startswith(infra):
            bad += [f"{a} imports the package {b}" for b in deps if b == loom]
    assert bad == [], "\n".join(bad)


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
    known["torchtitan_loom.tools.b"].write_text(
        "import importlib\nfrom torchtitan_loom.tools import a\n"
        "def g():\n    return importlib.import_module('torchtitan_loom.tools.c.thing')\n"
    )
    known["torchtitan_loom.tools.c"] = tmp_path / "c.py"
    assert imports(known["torchtitan_loom.tools.a"], "torchtitan_loom.tools.a", known) == {
        "torchtitan_loom.tools.b"
    }
    assert imports(known["torchtitan_loom.tools.b"], "torchtitan_loom.tools.b", known) == {
        "torchtitan_loom.tools.a",
        "torchtitan_loom.tools.c",  # a string import, through importlib
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


def _declared_outside_loom() -> set[str]:
    """Names the package declares for itself outside models/loom/ as typed fields of its own classes
    (config sections, dataclasses, NamedTuples): ``.eps`` there is optimizer.eps, not a LOOM norm's."""
    names = set()
    for path in PKG.rglob("*.py"):
        if path.relative_to(PKG).as_posix().startswith("models/loom/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names |= {
                    n.target.id
                    for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                }
    return names


def loom_members() -> set[str]:
    """What the LOOM modules define on their classes and instances (methods, properties, submodules,
    parameters, buffers, attributes), collected from the debug model built on meta, beyond what the
    protocols declare and what torch's own Module / Tensor define."""
    spec = get_train_spec("loom")
    with torch.device("meta"):
        model = spec.model_cls(spec.model_args["debug"])

    def is_loom(cls: type) -> bool:
        return cls.__module__.startswith("torchtitan_loom.models.loom")

    names = set()
    for module in model.modules():
        names |= {k for cls in type(module).__mro__ if is_loom(cls) for k in vars(cls)}
        if is_loom(type(module)):
            names |= set(vars(module)) | set(module._parameters) | set(module._buffers)
            names |= set(module._modules)
    declared = set(protocols.ModelProtocol.__annotations__) | set(protocols.ModelOutput._fields)
    for proto in (
        protocols.ModelProtocol,
        protocols.UpdatesAfterStep,
        protocols.DecodesIncrementally,
        protocols.ExitsPerToken,
    ):
        declared |= {k for k in vars(proto) if not k.startswith("_")}
    generic = set(dir(nn.Module)) | set(dir(torch.Tensor)) | {"weight", "bias"}
    return (
        {n for n in names if not n.startswith("__")} - declared - generic - _declared_outside_loom()
    )


def member_uses(source: str, members: set[str], rel: str) -> list[str]:
    """``.member`` (an attribute or a method call) or the string ``"member"`` (getattr, hasattr)."""
    hits = []
    toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, t in enumerate(toks):
        if t.type == tokenize.NAME and t.string in members and i and toks[i - 1].string == ".":
            hits.append(f"{rel}:{t.start[0]}: .{t.string}")
        elif t.type == tokenize.STRING and t.string.strip("'\"") in members:
            hits.append(f"{rel}:{t.start[0]}: {t.string}")
    return hits


def test_no_loom_member_outside_models_loom():
    members = loom_members()
    assert {
        "moe_layers",
        "expert_bias",
        "routers",
        "layers",
        "moe",
        "takes_capacity_slots",
    } <= members
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if not rel.startswith("models/loom/"):
            hits += member_uses(path.read_text(), members, rel)
    assert hits == [], "\n".join(hits)


def test_the_member_grep_catches_the_reviews_mutation():
    # What a review slipped past the earlier test, from a file in components/.
    src = (
        "biases = [m.expert_bias for m in model.moe_layers()]\n"
        "routers = model.layers[0].moe.routers\n"
        "impl = getattr(experts, 'impl', None)\n"
        "n = model.num_loops\n"  # the protocol's: no hit
    )
    hits = member_uses(src, loom_members(), "components/x.py")
    assert [h.split(": ")[1] for h in hits] == [
        ".expert_bias",
        ".moe_layers",
        ".layers",
        ".moe",
        ".routers",
        "'impl'",
    ]


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
