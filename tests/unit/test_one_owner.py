"""Facts with one owner, checked on the source: one dtype table (distributed/utils.py), every tool's
exit code from components/runtime/exit_codes.py, and no fallback default for a config key that could
disagree with the schema's (``getattr(section, "<schema key>", default)``)."""

import ast
from pathlib import Path

import torchtitan_loom
from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.config.schema import JobConfig
from torchtitan_loom.distributed.utils import DTYPES, SHORT_DTYPES

PKG = Path(torchtitan_loom.__file__).parent
DTYPE_NAMES = {"float32", "bfloat16", "float16", "float64", "half", "float"}


def sources():
    for path in sorted(PKG.rglob("*.py")):
        yield path.relative_to(PKG).as_posix(), ast.parse(path.read_text())


def dtype_tables(tree: ast.AST) -> list[int]:
    """Lines of a dict literal mapping to torch dtypes, or of ``getattr(torch, <not a literal>)``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and any(
            isinstance(v, ast.Attribute) and v.attr in DTYPE_NAMES for v in node.values
        ):
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "torch"
            and not isinstance(node.args[1], ast.Constant)
        ):
            lines.append(node.lineno)
    return lines


def test_one_dtype_table():
    found = {rel: lines for rel, tree in sources() if (lines := dtype_tables(tree))}
    # distributed/utils.py builds DTYPES and SHORT_DTYPES from its one table; the safe unpickler
    # resolves the torch globals a checkpoint pickle names (any of its allowed constants, not a
    # name -> dtype choice).
    assert set(found) <= {"distributed/utils.py", "components/checkpoint/safe_read.py"}, found
    assert set(DTYPES.values()) == set(SHORT_DTYPES.values())


def test_the_dtype_grep_finds_a_second_table():
    assert dtype_tables(ast.parse('D = {"fp32": torch.float32}\nx = getattr(torch, name)\n')) == [
        1,
        2,
    ]


def literal_exit_codes(tree: ast.AST) -> list[int]:
    """Lines of ``return <int>`` in a function named main, or of ``sys.exit(<int>)`` anywhere."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            lines += [
                r.lineno
                for r in ast.walk(node)
                if isinstance(r, ast.Return)
                and isinstance(r.value, ast.Constant)
                and isinstance(r.value.value, int)
            ]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "exit"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            lines.append(node.lineno)
    return lines


def test_every_entry_point_exits_with_the_named_codes():
    found = {rel: lines for rel, tree in sources() if (lines := literal_exit_codes(tree))}
    assert found == {}, found
    assert (exit_codes.OK, exit_codes.BAD_INPUT) == (0, 2)


def test_the_exit_code_grep_finds_a_literal():
    src = "def main():\n    if x:\n        return 2\n    return OK\nsys.exit(1)\n"
    assert literal_exit_codes(ast.parse(src)) == [3, 5]


def schema_keys() -> set[str]:
    """Every key of every [section] of the schema (the model's own keys included)."""
    import dataclasses

    cfg = JobConfig()
    return {
        f.name
        for section in dataclasses.fields(cfg)
        for f in dataclasses.fields(getattr(cfg, section.name))
    }


def fallback_defaults(tree: ast.AST, keys: set[str]) -> list[int]:
    """Lines of ``getattr(x, "<schema key>", default)``, default not None: a second default for a
    key the schema owns (``None`` only asks whether an object has the attribute)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) == 3
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in keys
        and not (isinstance(node.args[2], ast.Constant) and node.args[2].value is None)
    ]


def test_no_config_fallback_defaults():
    keys = schema_keys()
    assert "fsdp_sync" in keys
    hits = {rel: lines for rel, tree in sources() if (lines := fallback_defaults(tree, keys))}
    assert hits == {}, hits
    src = 'sync = getattr(par, "fsdp_sync", "micro_batch")\n'
    assert fallback_defaults(ast.parse(src), keys) == [1]
