"""LOOM's Hugging Face export (TrainSpec.hf_export_fn): the modeling file and the config.json
fields of ``tools.export --format hf`` (tools/hf_export.py writes the folder for any model whose
spec has one).

``modeling_loom.py`` is GENERATED from the package's own source: every module model.py needs,
found by following its imports (module-level and lazy, within models/loom/ outside infra/, plus
the generic data_contract.py and loop_request.py), each after the modules it imports from, with
the package-internal imports removed; then the two output types of protocols.py, model.py and the thin wrapper of
hf_wrapper_template.py. One copy of the same math, no list of files kept by hand (a module the
model starts to import is stitched in by construction); it imports nothing from torchtitan_loom.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

from torchtitan_loom.protocols import HfExport

_PKG = Path(__file__).resolve().parents[3]  # the torchtitan_loom package folder
MODELING_FILE = "modeling_loom.py"
MODEL_ROOT = "models/loom/model.py"
PROTOCOL_NAMES = ("ModelOutput", "Routing", "BEYOND_POLICIES")
WRAPPER_SOURCE = "models/loom/infra/hf_wrapper_template.py"


def _stitched(rel: str) -> bool:
    """A module whose source goes into the modeling file (protocols.py: only PROTOCOL_NAMES)."""
    return rel in ("data_contract.py", "loop_request.py") or (
        rel.startswith("models/loom/")
        and not rel.startswith("models/loom/infra/")
        and not rel.endswith("__init__.py")
    )


def _imported_files(node: ast.ImportFrom) -> list[str]:
    """The package files an import names: ``from torchtitan_loom.a.b import c`` is a/b.py, or
    a/b/c.py when c is a module."""
    parts = (node.module or "").split(".")[1:]
    found = []
    for alias in node.names:
        as_module = "/".join([*parts, alias.name]) + ".py"
        if (_PKG / as_module).is_file():
            found.append(as_module)
        elif parts:
            found.append("/".join(parts) + ".py")
    return found


def model_sources(root: str = MODEL_ROOT) -> tuple[str, ...]:
    """The stitched modules ``root`` needs, each after every module it imports from."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(rel: str) -> None:
        if rel in order:
            return
        if rel in visiting:
            raise RuntimeError(f"the model's modules import each other in a cycle at {rel}")
        visiting.add(rel)
        for node in ast.walk(ast.parse((_PKG / rel).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torchtitan_loom"
            ):
                for dep in _imported_files(node):
                    if _stitched(dep) and dep != rel:
                        visit(dep)
        visiting.discard(rel)
        order.append(rel)

    visit(root)
    return tuple(r for r in order if r != root)


def _is_internal(node: ast.stmt) -> bool:
    """An import of the package itself, or ``from __future__`` (hoisted to the top once)."""
    if isinstance(node, ast.ImportFrom):
        return node.module == "__future__" or (node.module or "").startswith("torchtitan_loom")
    if isinstance(node, ast.Import):
        return any(a.name.startswith("torchtitan_loom") for a in node.names)
    return False


def _strip(source: str, keep: tuple[str, ...] | None = None) -> tuple[str, set[str]]:
    """The module source without internal imports (only the top-level definitions named in
    ``keep`` when given, plus its plain imports), and the names it defines at top level."""
    tree = ast.parse(source)
    lines = source.splitlines()
    pieces: list[tuple[bool, str]] = []  # (is an import, its text)
    defined: set[str] = set()
    for node in tree.body:
        if _is_internal(node):
            continue
        name = getattr(node, "name", None)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id  # a constant, kept by its name like a class
        if (
            keep is not None
            and not isinstance(node, (ast.Import, ast.ImportFrom))
            and name not in keep
        ):
            continue
        if name is not None:
            defined.add(name)
        for target in getattr(node, "targets", []):
            if isinstance(target, ast.Name):
                defined.add(target.id)
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        # Lazy internal imports inside functions go too: their names are stitched in at top level.
        nested = {
            n
            for sub in ast.walk(node)
            if sub is not node
            and isinstance(sub, (ast.Import, ast.ImportFrom))
            and _is_internal(sub)
            for n in range(sub.lineno, (sub.end_lineno or sub.lineno) + 1)  # parse sets it
        }
        text = "\n".join(
            line
            for n, line in enumerate(lines[start - 1 : node.end_lineno], start)
            if n not in nested
        )
        is_import = isinstance(node, (ast.Import, ast.ImportFrom))
        if pieces and not (is_import and pieces[-1][0]):
            text = "\n\n" + text  # PEP 8 spacing between top-level statements
        pieces.append((is_import, text))
    return "\n".join(text for _, text in pieces), defined


def modeling_source() -> str:
    """The standalone modeling file (see the module doc)."""
    parts = [
        '"""LOOM for transformers: GENERATED by `python -m torchtitan_loom.tools.export --format hf` from\n'
        'the torchtitan_loom model source; do not edit (regenerate it instead)."""\n',
        "from __future__ import annotations\n",
    ]
    seen: dict[str, str] = {}
    sources = [(s, None) for s in model_sources()] + [
        ("protocols.py", PROTOCOL_NAMES),
        (MODEL_ROOT, None),
        (WRAPPER_SOURCE, None),
    ]
    for rel, keep in sources:
        body, defined = _strip((_PKG / rel).read_text(), keep)
        clash = sorted(n for n in defined if n in seen and not n.isupper())
        if clash:
            raise RuntimeError(
                f"{rel} redefines {clash} already defined by {seen[clash[0]]}; rename one of them"
            )
        seen.update({n: rel for n in defined})
        parts.append(f"\n# {'-' * 70} from torchtitan_loom/{rel}\n\n{body}\n")
    return "\n".join(parts)


def loom_hf_export(args: Any) -> HfExport:
    """The modeling file and the model's own config.json fields for LOOM args ``args``."""
    config = {
        "architectures": ["LoomForCausalLM"],
        "model_type": "loom",
        "auto_map": {
            "AutoConfig": "modeling_loom.LoomConfig",
            "AutoModelForCausalLM": "modeling_loom.LoomForCausalLM",
        },
        "loom_args": dataclasses.asdict(args),
        "loops": None,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "use_cache": False,
    }
    return HfExport(MODELING_FILE, modeling_source(), config)
