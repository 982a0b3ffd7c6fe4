"""Packer from Hugging Face datasets (--hf-dataset), with datasets made on the fly (no download):
the same documents give the same pack as --jsonl; --streaming writes no Arrow cache (nothing
materialised); the progress line carries an ETA when the row count is known."""

import filecmp
import json
import os
import subprocess
import sys

import pytest

from torchtitan_loom.tools import pack as cli
from torchtitan_loom.tools import pack_build

datasets = pytest.importorskip("datasets")

DOCS = [f"row {i}: " + "the quick brown fox " * (i % 5) for i in range(240)]
PACK_FLAGS = [
    "--tokenizer",
    "byte",
    "--seq-len",
    "64",
    "--epochs",
    "2",
    "--holdout-tokens",
    "300",
    "--workers",
    "1",
]


@pytest.fixture
def reference_pack(tmp_path):
    jl = tmp_path / "docs.jsonl"
    jl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    assert cli.main(["--jsonl", str(jl), "--out", str(tmp_path / "ref"), *PACK_FLAGS]) == 0
    return tmp_path / "ref"


def same_pack(a, b):
    assert filecmp.cmp(a / "tokens.npy", b / "tokens.npy", shallow=False)
    for epoch in ("epoch_0", "epoch_1", "epoch_2"):
        for f in sorted(os.listdir(a / epoch)):
            assert filecmp.cmp(a / epoch / f, b / epoch / f, shallow=False), f"{epoch}/{f}"


def test_saved_dataset_packs_like_jsonl_with_an_eta(reference_pack, tmp_path, monkeypatch, capsys):
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))}).save_to_disk(
        str(saved)
    )
    monkeypatch.setattr(
        pack_build, "PROGRESS_EVERY_S", 0.0
    )  # a line per batch, so the small test sees one
    monkeypatch.setattr(pack_build, "DOCS_PER_TASK", 64)
    assert cli.main(["--hf-dataset", str(saved), "--out", str(tmp_path / "hf"), *PACK_FLAGS]) == 0
    same_pack(reference_pack, tmp_path / "hf")
    err = capsys.readouterr().err
    assert "64 docs" in err and f"% of {len(DOCS)} docs, ETA" in err, err
    meta = json.loads((tmp_path / "hf" / "metadata.json").read_text())
    assert meta["hf_dataset"] == {
        "name": str(saved),
        "config": None,
        "split": None,
    }  # a saved Dataset has no splits


def test_streaming_parquet_materialises_nothing(reference_pack, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": DOCS}), tmp_path / "part-0.parquet", row_group_size=50)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    results = {}
    for mode in ("streaming", "materialised"):
        cache = tmp_path / f"cache_{mode}"
        cmd = [
            sys.executable,
            "-m",
            "torchtitan_loom.tools.pack",
            "--hf-dataset",
            "parquet",
            "--hf-data-files",
            str(tmp_path / "part-0.parquet"),
            "--out",
            str(tmp_path / mode),
            *PACK_FLAGS,
        ]
        proc = subprocess.run(
            cmd + (["--streaming"] if mode == "streaming" else []),
            capture_output=True,
            text=True,
            timeout=180,
            env=dict(env, HF_DATASETS_CACHE=str(cache)),
        )
        assert proc.returncode == 0, proc.stderr
        same_pack(reference_pack, tmp_path / mode)
        results[mode] = [f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".arrow")]
    assert results["streaming"] == []  # no Arrow copy of the corpus was written
    assert results["materialised"], (
        "the non-streaming load should have cached Arrow files (the check's control)"
    )


def test_missing_text_column_is_one_line(tmp_path, capsys):
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": DOCS[:5]}).save_to_disk(str(saved))
    capsys.readouterr()  # the save's progress bar
    assert cli.main(["--hf-dataset", str(saved), "--out", str(tmp_path / "x"), *PACK_FLAGS]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "error: --hf-dataset row 0 has no column 'text' (columns: ['body']); set --text-field"
    ], err


def test_bad_hf_inputs_exit_2_with_one_line(tmp_path, capsys):
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": DOCS[:5]}).save_to_disk(str(saved))
    capsys.readouterr()  # the save's progress bar
    cases = [  # (arguments, what the line says)
        (
            ["--hf-dataset", str(saved), "--hf-split", "validation"],
            "it has no splits; leave --hf-split out",
        ),
        (["--hf-dataset", str(tmp_path / "no" / "such" / "dir")], "no such directory"),
    ]
    for extra, expected in cases:
        code = cli.main([*extra, "--out", str(tmp_path / "x"), *PACK_FLAGS])
        err = capsys.readouterr().err
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, (extra, err)
        assert "Traceback" not in err and not (tmp_path / "x").exists()
    # The saved Dataset itself still packs without --hf-split (it has no split to choose).
    assert (
        cli.main(["--hf-dataset", str(saved), "--out", str(tmp_path / "ok"), *PACK_FLAGS[:-4]]) == 0
    )
