"""What the repository may carry: every tracked file (``git ls-files``) is text, unless it lies in a
declared asset folder with a declared suffix, and none is larger than MAX_BYTES. A wheel, an
archive or a model file committed by mistake fails here, naming the file and the rule.

The limit and the asset folders, each with its reason, are declared below and nowhere else.
"""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# One limit for every tracked file: the largest one today is a 146 kB figure of docs/, the frozen
# checkpoint fixture's files are < 1 MB each. A file above it (a dataset, a wheel, weights) belongs
# in a release asset or a cache, not in every clone.
MAX_BYTES = 1 << 20
# Folders whose binary files are declared, with the suffixes allowed there and why.
ASSET_FOLDERS: dict[str, tuple[tuple[str, ...], str]] = {
    "docs/": (
        (".png",),
        "the figures the docs show, written by scripts/refresh_docs.py from real runs",
    ),
    "tests/fixtures/": (
        (".distcp", ".metadata", ".npy"),
        "a small frozen run (DCP shards and metadata, its pack's arrays), read by the tests that "
        "keep old checkpoints loadable",
    ),
}
SNIFF_BYTES = 8192  # a NUL byte or invalid UTF-8 in the first 8 KiB makes a file binary


def is_binary(head: bytes) -> bool:
    """A file that is not UTF-8 text: a NUL byte, or bytes UTF-8 cannot decode (a multi-byte
    character cut at the end of the sniffed head is still text)."""
    if b"\0" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start < len(head) - 3
    return False


def problems(root: Path, paths: list[str]) -> list[str]:
    """One line per tracked file that breaks a rule (see the module)."""
    out = []
    for rel in paths:
        path = root / rel
        if path.is_symlink() or not path.is_file():
            continue  # a link is text in git; a file deleted in the work tree is git's to report
        size = path.stat().st_size
        if size > MAX_BYTES:
            out.append(f"{rel}: {size:,} bytes, over the {MAX_BYTES:,}-byte limit per file")
        with path.open("rb") as fh:
            if not is_binary(fh.read(SNIFF_BYTES)):
                continue
        folder = next((f for f in ASSET_FOLDERS if rel.startswith(f)), None)
        if folder is None:
            out.append(
                f"{rel}: a binary file outside the asset folders ({', '.join(ASSET_FOLDERS)})"
            )
        elif not rel.endswith(ASSET_FOLDERS[folder][0]):
            out.append(
                f"{rel}: a binary file of a kind {folder} does not declare "
                f"({', '.join(ASSET_FOLDERS[folder][0])})"
            )
    return out


def tracked(root: Path) -> list[str]:
    try:
        proc = subprocess.run(
            ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True, timeout=60
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tree check needs git ls-files")
    return [p for p in proc.stdout.decode().split("\0") if p]


def test_the_tree_holds_no_stray_binary_and_no_large_file():
    paths = tracked(ROOT)
    assert len(paths) > 100 and "README.md" in paths
    found = problems(ROOT, paths)
    assert found == [], "the tracked tree breaks the rules of tests/unit/test_tree_files.py:\n" + (
        "\n".join(found)
    )


def test_the_rules_catch_a_wheel_a_large_text_and_an_undeclared_asset(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests" / "fixtures").mkdir(parents=True)
    files = {
        "tool-0.1-py3-none-any.whl": b"PK\x03\x04\x14\x00\x00\x00" + bytes(range(256)),
        "data.txt": b"x" * (MAX_BYTES + 1),
        "docs/figure.png": b"\x89PNG\r\n\x1a\n\0\0",
        "docs/figure.gif": b"GIF89a\0\0",
        "tests/fixtures/ckpt/__0_0.distcp": b"\0\1\2",
        "notes/café.md": "un café, déjà".encode(),
        "cut.md": "é".encode() * (SNIFF_BYTES // 2) + "é".encode(),  # a character cut at 8 KiB
    }
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    assert problems(tmp_path, sorted(files)) == [
        f"data.txt: {MAX_BYTES + 1:,} bytes, over the {MAX_BYTES:,}-byte limit per file",
        "docs/figure.gif: a binary file of a kind docs/ does not declare (.png)",
        "tool-0.1-py3-none-any.whl: a binary file outside the asset folders "
        "(docs/, tests/fixtures/)",
    ]
