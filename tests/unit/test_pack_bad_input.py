"""A damaged pack answers with one line naming the file, the key or position, the bad value and
what is valid (PackError; exit 2 from the trainer's config check and from `tools.pack --verify`),
before training, never a traceback at step 1. And the packer says what it waits on."""

import json
import os
import pickle
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from torchtitan_loom.components.data import (
    PackError,
    PackWriter,
    build_train_loader,
    open_pack,
    pack_arrays,
)
from torchtitan_loom.components.data.pack_metadata import METADATA_MAX_BYTES, read_metadata
from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.tools import pack as pack_tool

ROOT = Path(__file__).resolve().parents[2]
BYTE_INFO = {"vocab_size": 258, "name_or_path": "byte", "eos_token_id": 256}


@pytest.fixture
def pack(tmp_path):
    """A small byte pack: records of ≤ 33 tokens (seq_len 32), 2 orderings and a holdout."""
    with PackWriter(tmp_path / "pack", BYTE_INFO, max_seq_len=33) as w:
        for i in range(120):
            w.add_document(np.frombuffer(f"document {i}: {'ab' * (i % 9)}".encode(), np.uint8))
        return w.finish(epochs=2, holdout_tokens=200, seed=0)


def open_error(path, vocab_size=258):
    """The one-line PackError of opening ``path`` for the debug model (seq_len 32)."""
    with pytest.raises(PackError) as exc:
        open_pack(path, seq_len=32, vocab_size=vocab_size)
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1 and str(path) in msg, msg
    return msg


def edit_meta(path, **changes):
    meta = json.loads((path / "metadata.json").read_text())
    for key, value in changes.items():
        where = meta
        *parents, leaf = key.split(".")
        for p in parents:
            where = where[p]
        where[leaf] = value
    (path / "metadata.json").write_text(json.dumps(meta))


def set_raw(path, key, raw):
    """Put the literal JSON text ``raw`` as the value of top-level ``key`` (1e999, NaN, ...)."""
    meta = json.loads((path / "metadata.json").read_text())
    meta[key] = "@@RAW@@"
    (path / "metadata.json").write_text(json.dumps(meta).replace('"@@RAW@@"', raw))


# ------------------------------------------------------------------------------ metadata values
@pytest.mark.parametrize(
    "key, raw, shown, valid",
    [
        ("total_length", "1e999", "is inf", "integer in 0..281,474,976,710,656"),
        ("total_length", "-5", "is -5", "integer in 0.."),
        ("total_length", "1" * 60, "is 1111111111", "integer in 0.."),
        ("max_seq_len", '"abc"', "is 'abc'", "integer in 2..2,147,483,647"),
        ("max_seq_len", "33.0", "is 33.0", "integer in 2.."),
        ("max_seq_len", "null", "is null", "integer in 2.."),
        ("max_seq_len", "NaN", "is nan", "integer in 2.."),
        ("max_token_id", "null", "is null", "integer in -1.."),
        ("max_token_id", "true", "is true", "integer in -1.."),
        ("holdout_epoch", "1e30", "is 1e+30", "integer in 0..1,000,000"),
        ("num_records", "[1, 2]", "is a JSON array of 2 items", "integer in 0.."),
    ],
)
def test_bad_metadata_value_names_key_value_and_range(pack, key, raw, shown, valid):
    set_raw(pack, key, raw)
    msg = open_error(pack)
    assert f"metadata.json key {key!r} {shown}" in msg and valid in msg, msg
    assert len(msg) < 400, msg  # a 60-digit number is echoed shortened


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("tokenizer_info.vocab_size", None, "'tokenizer_info.vocab_size' is null"),
        ("tokenizer_info.vocab_size", 1 << 40, "'tokenizer_info.vocab_size' is 1099511627776"),
        ("tokenizer_info.eos_token_id", "256", "'tokenizer_info.eos_token_id' is '256'"),
        ("tokenizer_info.eos_token_id", -1, "'tokenizer_info.eos_token_id' is -1"),
        ("tokenizer_info.name_or_path", 5, "'tokenizer_info.name_or_path' is 5"),
        ("tokenizer_info", "byte", "lacks ['tokenizer_info']"),
    ],
)
def test_bad_tokenizer_info(pack, key, value, expected):
    edit_meta(pack, **{key: value})
    assert expected in open_error(pack)


def test_metadata_that_is_not_a_json_object(pack):
    (pack / "metadata.json").write_text("[1, 2, 3]")
    assert "metadata.json holds a JSON array of 3 items, not a JSON object" in open_error(pack)


@pytest.mark.parametrize("where", ["top", "value"])
def test_deeply_nested_metadata_is_one_line(pack, where):
    deep = "[" * 100_000 + "]" * 100_000
    if where == "top":
        (pack / "metadata.json").write_text(deep)
    else:
        set_raw(pack, "seed", deep)
    assert "metadata.json is not valid JSON (nested too deeply to parse)" in open_error(pack)


def test_huge_metadata_is_refused_unread(pack):
    text = (pack / "metadata.json").read_text()
    (pack / "metadata.json").write_text(text + " " * (METADATA_MAX_BYTES + 1))
    msg = open_error(pack)
    assert f"larger than the {METADATA_MAX_BYTES:,} bytes" in msg, msg


def test_fifo_link_or_folder_at_metadata_path(pack, tmp_path):
    real = tmp_path / "elsewhere.json"
    shutil.move(pack / "metadata.json", real)
    (pack / "metadata.json").symlink_to(real)
    assert "metadata.json is a symbolic link" in open_error(pack)
    (pack / "metadata.json").unlink()
    os.mkfifo(pack / "metadata.json")  # nobody writes it: a blocking open would hang here
    assert "metadata.json is a FIFO, not a regular file" in open_error(pack)
    (pack / "metadata.json").unlink()
    (pack / "metadata.json").mkdir()
    assert "metadata.json is a directory" in open_error(pack)


def test_verify_cli_answers_damaged_metadata_with_one_line(pack, capsys):
    set_raw(pack, "total_length", "1e999")
    assert pack_tool.main(["--verify", str(pack)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: pack ") and "'total_length' is inf" in err, err
    assert len(err.strip().splitlines()) == 1


def test_read_metadata_returns_the_validated_fields(pack):
    meta = read_metadata(pack)
    assert meta["tokenizer_info"] == BYTE_INFO and meta["max_seq_len"] == 33
    assert meta["total_length"] == len(np.load(pack / "tokens.npy"))


# -------------------------------------------------------------------- consistency of the arrays
def test_token_array_longer_than_its_header(pack):
    with open(pack / "tokens.npy", "ab") as fh:
        fh.write(b"\0" * 10)
    assert "tokens.npy is longer than its header says" in open_error(pack)


def test_token_dtype_too_narrow_for_the_tokenizer(pack):
    edit_meta(pack, **{"tokenizer_info.vocab_size": 100_000})
    msg = open_error(pack, vocab_size=100_352)
    assert "tokens.npy stores uint16 but the tokenizer has 100,000 ids" in msg, msg


def test_record_start_that_would_wrap_around(pack):
    start = np.load(pack / "epoch_0" / "doc_start.npy")
    start[3] = np.iinfo(np.int64).max - 5  # start + length overflows int64 to a negative number
    np.save(pack / "epoch_0" / "doc_start.npy", start)
    assert "epoch_0 record 3 (start 9223372036854775802" in open_error(pack)


# --------------------------------------------------------------------------------- token ids
def damage_token(pack, position, value):
    tokens = np.load(pack / "tokens.npy", mmap_mode="r+")
    tokens[position] = value
    tokens.flush()
    del tokens


def test_token_beyond_vocab_is_found_at_open_not_at_step_1(pack):
    open_pack(pack, seq_len=32, vocab_size=258)  # scanned and memoised while intact
    damage_token(pack, 777, 400)  # metadata still says max_token_id 256
    msg = open_error(pack)
    assert "token id 400 is ≥ the model vocab_size 258 (tokens.npy position 777 of" in msg, msg
    assert "the pack's tokenizer has 258 ids" in msg and "re-pack" in msg
    with pytest.raises(PackError, match="position 777"):  # the loader, before any batch
        build_train_loader(pack, 32, 258, global_batch_rows=2, dp_rank=0, dp_world=1)


def test_negative_token_id_in_a_signed_stream(pack):
    tokens = np.load(pack / "tokens.npy").astype(np.int32)
    tokens[[50, 90]] = -3
    np.save(pack / "tokens.npy", tokens)
    assert "token id -3 is negative (tokens.npy position 50 of" in open_error(pack)


def test_scan_is_memoised_per_file_identity(pack):
    f = pack / "tokens.npy"
    open_pack(pack, seq_len=32, vocab_size=258)
    before = pack_arrays._scanned_range.cache_info()
    open_pack(pack, seq_len=32, vocab_size=258)
    after = pack_arrays._scanned_range.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses
    epochs = [p.name for p in pack.iterdir() if p.name.startswith("epoch_")]
    assert sorted(os.listdir(pack)) == sorted(["metadata.json", "tokens.npy", *epochs])  # no cache
    tokens = np.load(f)
    assert pack_arrays.token_range(pack, f) == (int(tokens.min()), int(tokens.max()))


def test_slow_scan_prints_progress(pack, monkeypatch, capsys):
    monkeypatch.setattr(pack_arrays, "SCAN_BLOCK", 64)
    monkeypatch.setattr(pack_arrays, "PROGRESS_AFTER_S", 0.0)
    pack_arrays._scanned_range.cache_clear()
    open_pack(pack, seq_len=32, vocab_size=258)
    err = capsys.readouterr().err
    assert f"pack '{pack}': checking token ids, 64 of" in err, err


# ------------------------------------------------------------------- files that are not arrays
class _Touch:
    """Unpickling this would create ``path``: proof that nothing in the file is executed."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("name", ["tokens.npy", "epoch_0/doc_len.npy"])
@pytest.mark.parametrize("content", ["garbage", "pickle"])
def test_not_an_array_file_never_suggests_unsafe_loading(pack, tmp_path, name, content):
    marker = tmp_path / "pwned"
    data = os.urandom(300) if content == "garbage" else pickle.dumps([_Touch(marker)])
    (pack / name).write_bytes(data)
    msg = open_error(pack)
    assert f"{name} is not a valid token array" in msg and "re-pack the corpus" in msg, msg
    assert "pickle" not in msg.lower() and "unsafe" not in msg.lower(), msg
    assert not marker.exists()


def test_object_array_is_refused_by_dtype(pack):
    np.save(pack / "tokens.npy", np.array([1, "x", None], dtype=object), allow_pickle=True)
    msg = open_error(pack)
    assert "tokens.npy has dtype object" in msg and "pickle" not in msg.lower(), msg


def test_verify_cli_on_garbage_tokens_is_one_line(pack, capsys):
    (pack / "tokens.npy").write_bytes(b"\x80\x04garbage that numpy would call a pickle")
    assert pack_tool.main(["--verify", str(pack)]) == 2
    err = capsys.readouterr().err
    assert "tokens.npy is not a valid token array" in err and "allow_pickle" not in err, err
    assert len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------ through the trainer
def train_argv(pack, dump):
    return [
        "--data.path",
        str(pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "2",
        "--training.micro_batch_size",
        "2",
        "--training.steps",
        "1",
        "--eval.interval",
        "0",
        "--metrics.enable_tensorboard",
        "false",
    ]


def test_config_check_reports_damaged_pack_in_one_line(pack, tmp_path):
    damage_token(pack, 10, 600)  # the debug flavor's vocabulary is 512
    with pytest.raises(ConfigError) as exc:
        resolve(load_config(train_argv(pack, tmp_path / "run")), 1)
    msg = str(exc.value)
    assert msg.startswith("data.path: pack") and len(msg.splitlines()) == 1, msg
    assert "token id 600 is ≥ the model vocab_size 512 (tokens.npy position 10" in msg
    set_raw(pack, "total_length", '"abc"')
    with pytest.raises(ConfigError, match="'total_length' is 'abc'"):
        resolve(load_config(train_argv(pack, tmp_path / "run")), 1)


@pytest.mark.parametrize(
    "key, raw",
    [("max_seq_len", "1e999"), ("tokenizer_info", '{"vocab_size": 1e999, "eos_token_id": 256}')],
)
def test_config_check_on_metadata_fields_it_reads_itself(pack, tmp_path, key, raw):
    set_raw(pack, key, raw)
    with pytest.raises(ConfigError, match=f"metadata.json key '{key}[.a-z_]*' is inf"):
        resolve(load_config(train_argv(pack, tmp_path / "run")), 1)


def test_train_cli_damaged_tokens_exit_2_one_line(pack, tmp_path):
    damage_token(pack, 10, 600)
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.train", *train_argv(pack, tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "token id 600 is ≥ the model vocab_size 512" in lines[0], lines
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------- the packer
def test_packer_says_what_it_waits_on_before_reading_a_slow_source(tmp_path):
    """A named pipe as --text (as `--text <(zcat x.gz)` passes one) blocks the read until written:
    the packer must print what it waits on before any document is read or tokenised."""
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torchtitan_loom.tools.pack", "--text", str(fifo)]
    cmd += ["--text-split", "line", "--out", str(out), "--workers", "1", "--seq-len", "64"]
    cmd += ["--epochs", "1", "--holdout-tokens", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True)
    reader.start()
    try:
        first = lines.get(timeout=120)  # nothing has been written into the pipe yet
        assert first.startswith(f"pack: reading '{fifo}' (file 1 of 1, a pipe)"), first
        assert not out.exists()
        with open(fifo, "w") as fh:
            fh.write("".join(f"line number {i}\n" for i in range(50)))
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert any("50 docs" in x for x in rest) and rest[-1].startswith("wrote "), rest
    assert open_pack(out, seq_len=63, vocab_size=258).metadata["num_documents"] == 50


def test_packer_fast_error_stays_one_line(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"nope": 1}\n')
    started = time.perf_counter()
    jsonl, out = str(tmp_path / "a.jsonl"), str(tmp_path / "o")
    code = pack_tool.main(["--jsonl", jsonl, "--out", out, "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 2 and f"{tmp_path / 'a.jsonl'}:2:" in err, err
    if time.perf_counter() - started < 3.5:  # quicker than the quiet limit: no progress line
        assert len(err.strip().splitlines()) == 1, err
