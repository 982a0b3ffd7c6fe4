"""Packer CLI: help text, inputs, determinism across workers, atomic output, --verify."""

import filecmp
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from torchtitan_loom.components.data import open_pack
from torchtitan_loom.tools import pack as cli

DOCS = [f"document {i}: " + "lorem ipsum " * (i % 7) for i in range(300)]


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.tools.pack", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def corpus(tmp_path):
    jl = tmp_path / "a.jsonl"
    jl.write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS[:200]))
    )
    (tmp_path / "b1.txt").write_text("\n\n".join(DOCS[200:250]))
    (tmp_path / "b2.txt").write_text("\n\n".join(DOCS[250:]))
    return tmp_path


def test_help_documents_every_flag():
    proc = run("--help")
    assert proc.returncode == 0
    parser = cli.build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    expected = {
        "--jsonl",
        "--text",
        "--parquet",
        "--tokenizer",
        "--out",
        "--seq-len",
        "--epochs",
        "--holdout-tokens",
        "--workers",
        "--seed",
        "--verify",
        "--text-field",
        "--force",
        "--eos-token",
    }
    assert expected <= {s for a in flags for s in a.option_strings}
    for a in flags:
        assert a.help and len(a.help) > 15, a.option_strings
        assert a.option_strings[0] in proc.stdout


def test_cli_pack_then_verify_subprocess(corpus):
    out = corpus / "pack"
    proc = run(
        "--jsonl",
        corpus / "a.jsonl",
        "--text",
        corpus / "b*.txt",
        "--text-split",
        "blankline",
        "--out",
        out,
        "--seq-len",
        "64",
        "--epochs",
        "3",
        "--holdout-tokens",
        "500",
        "--workers",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "docs" in proc.stderr and "tokens" in proc.stderr and "/s" in proc.stderr
    )  # progress line
    pack = open_pack(out, seq_len=63, vocab_size=258, tokenizer_name="byte")
    meta = pack.metadata
    assert (
        meta["num_documents"] == 300
        and pack.training_epochs == (0, 1, 2)
        and pack.holdout_epoch == 3
    )
    # stream = every document + EOS in input order (jsonl, then the text files, sorted by the glob)
    expected = [b for d in DOCS for b in list(d.encode()) + [256]]
    assert pack.tokens.tolist() == expected
    v = run("--verify", out)
    assert v.returncode == 0, v.stderr
    stats = dict(line.split(": ", 1) for line in v.stdout.strip().splitlines())
    assert stats["tokens"] == str(len(expected)) and stats["holdout_epoch"] == "3"
    assert stats["token_id_range"] == "[32, 256]" and stats["training_epochs"] == "[0, 1, 2]"
    assert float(stats["mean_record_length"]) > 10 and int(stats["holdout_records"]) >= 1


def test_output_is_identical_for_any_number_of_workers(corpus):
    outs = []
    for workers in (1, 3):
        out = corpus / f"w{workers}"
        assert (
            cli.main(
                [
                    "--jsonl",
                    str(corpus / "a.jsonl"),
                    "--out",
                    str(out),
                    "--seq-len",
                    "32",
                    "--holdout-tokens",
                    "100",
                    "--workers",
                    str(workers),
                    "--epochs",
                    "2",
                ]
            )
            == 0
        )
        outs.append(out)
    for rel in (
        "tokens.npy",
        "epoch_0/doc_start.npy",
        "epoch_1/doc_len.npy",
        "epoch_2/doc_start.npy",
    ):
        assert filecmp.cmp(outs[0] / rel, outs[1] / rel, shallow=False), rel


def test_refuses_to_overwrite_without_force(corpus, capsys):
    out = corpus / "p"
    args = [
        "--jsonl",
        str(corpus / "a.jsonl"),
        "--out",
        str(out),
        "--workers",
        "1",
        "--holdout-tokens",
        "0",
    ]
    assert cli.main(args) == 0
    assert cli.main(args) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert cli.main(args + ["--force", "--seq-len", "16"]) == 0
    assert json.loads((out / "metadata.json").read_text())["max_seq_len"] == 16
    assert (
        sorted(p.name for p in corpus.iterdir() if p.name.startswith(".")) == []
    )  # no temp dirs left


def test_parquet_input_and_text_field(corpus, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": DOCS[:40]}), corpus / "c.parquet", row_group_size=16)
    out = corpus / "pq"
    assert (
        cli.main(
            [
                "--parquet",
                str(corpus / "c.parquet"),
                "--text-field",
                "body",
                "--out",
                str(out),
                "--workers",
                "1",
                "--holdout-tokens",
                "0",
                "--epochs",
                "1",
            ]
        )
        == 0
    )
    assert open_pack(out, 1023, 258).tokens.tolist() == [
        b for d in DOCS[:40] for b in list(d.encode()) + [256]
    ]
    assert (
        cli.main(
            ["--parquet", str(corpus / "c.parquet"), "--out", str(corpus / "x"), "--workers", "1"]
        )
        == 2
    )
    assert "no column 'text'" in capsys.readouterr().err


def test_input_errors_are_clear(corpus, capsys):
    assert cli.main(["--jsonl", "nothing*.jsonl", "--out", str(corpus / "x")]) == 2
    assert "--jsonl 'nothing*.jsonl' matches no file" in capsys.readouterr().err
    (corpus / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    assert (
        cli.main(
            ["--jsonl", str(corpus / "bad.jsonl"), "--out", str(corpus / "x"), "--workers", "1"]
        )
        == 2
    )
    assert re.search("bad.jsonl:2: .*--text-field", capsys.readouterr().err)
    assert not (corpus / "x").exists()


def test_verify_rejects_a_damaged_pack(corpus):
    out = corpus / "p"
    assert (
        cli.main(
            [
                "--jsonl",
                str(corpus / "a.jsonl"),
                "--out",
                str(out),
                "--workers",
                "1",
                "--holdout-tokens",
                "0",
                "--epochs",
                "1",
            ]
        )
        == 0
    )
    tokens = np.load(out / "tokens.npy")
    tokens[7] = 400  # beyond the byte vocab; metadata still claims max_token_id 256
    np.save(out / "tokens.npy", tokens)
    proc = run("--verify", out)
    assert proc.returncode != 0
    assert "token id 400 is ≥ the model vocab_size 258" in proc.stderr and str(out) in proc.stderr
