"""Each file name of a run folder and its checkpoints is spelled in one module,
components/checkpoint/names.py: a string literal equal to one of them anywhere else in the package
fails here (a message may still say the name, through the constant)."""

import ast
from pathlib import Path

import torchtitan_loom
from torchtitan_loom.components.checkpoint import names

PKG = Path(torchtitan_loom.__file__).parent
OWNER = "components/checkpoint/names.py"
FILE_NAMES = {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}


def spelled(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every string constant that is exactly one of the file names."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in FILE_NAMES
    ]


def test_the_names_module_holds_the_checkpoint_files():
    assert {"meta.json", "config.toml", "model_args.json", "run.json", ".metadata"} <= FILE_NAMES
    assert {"COMPLETE", "CHECKSUMS.json", "index.json", "LAYOUT.md", "KEEP"} <= FILE_NAMES


def test_each_file_name_is_spelled_in_one_module():
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        hits = spelled(ast.parse(path.read_text()))
        if hits and rel != OWNER:
            found[rel] = hits
    assert found == {}, f"spell these through {OWNER}: {found}"


def test_the_grep_finds_a_second_spelling():
    tree = ast.parse('import os\np = os.path.join(d, "meta.json")\nq = f"{d}/x"\n')
    assert spelled(tree) == [(2, "meta.json")]
