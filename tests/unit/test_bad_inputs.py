"""Every bad input of issue #11 gives one line naming the key or path and exit 2 (or the packer's
one-line error), before any process group; and a full disk during a save says so."""

import errno
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from torchtitan_loom import train
from torchtitan_loom.components.checkpoint import integrity, tree
from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.tools import pack as pack_tool

ROOT = Path(__file__).resolve().parents[2]


def errors_of(*argv):
    with pytest.raises(ConfigError) as exc:
        resolve(load_config(list(argv)), 1)
    return str(exc.value)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--optimizer.lr", "nan"], "optimizer.lr = nan: must be a finite number > 0"),
        (["--optimizer.lr", "inf"], "optimizer.lr = inf: must be a finite number > 0"),
        (["--optimizer.beta1", "1.5"], "optimizer.beta1 = 1.5: must lie in [0, 1)"),
        (
            ["--optimizer.weight_decay", "-0.1"],
            "optimizer.weight_decay = -0.1: must be a finite number ≥ 0",
        ),
        (["--training.max_norm", "nan"], "training.max_norm = nan: must be a finite number"),
        (["--spike_guard.delta", "-1"], "spike_guard.delta = -1.0: must be a finite number ≥ 0"),
        (
            ["--spike_guard.noise_sigmas", "nan"],
            "spike_guard.noise_sigmas = nan: must be a finite number ≥ 0",
        ),
        (["--spike_guard.noise_ema", "1"], "spike_guard.noise_ema = 1.0: must lie in [0, 1)"),
        (
            ["--spike_guard.max_consecutive_skips", "-1"],
            "spike_guard.max_consecutive_skips = -1: must be ≥ 0",
        ),
        (
            ["--lr_scheduler.warmup_ratio", "0.6", "--lr_scheduler.decay_ratio", "0.6"],
            "lr_scheduler.warmup_ratio + decay_ratio = 0.6 + 0.6: must be ≤ 1",
        ),
        (
            ["--data.path", "", "--training.seq_len", "300", "--model.attn_backend", "sdpa"],
            "training.seq_len = 300: the bundled corpus (data.path empty) holds records of 257 tokens",
        ),
    ],
)
def test_bad_numbers_and_ranges(tmp_path, argv, expected):
    assert expected in errors_of("--job.dump_folder", str(tmp_path / "run"), *argv)


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is not None, reason="flash-attn installed"
)
def test_flash_attn_missing_is_a_config_error(tmp_path):
    assert (
        "model.attn_backend = 'flash_attn': the flash-attn package is not installed"
        in errors_of("--job.dump_folder", str(tmp_path), "--model.attn_backend", "flash_attn")
    )


def read_only_dir(tmp_path):
    """A directory this process cannot write, also as root (a read-only tmpfs mount)."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        return d
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True
    ).returncode:
        pytest.skip("root without permission to mount a read-only tmpfs")
    return d


@pytest.mark.parametrize("where", ["under_a_file", "not_creatable", "read_only"])
def test_dump_folder_that_cannot_be_written(tmp_path, where):
    if where == "under_a_file":
        (tmp_path / "file").write_text("x")
        dump, expected = tmp_path / "file" / "run", "is a file"
    elif where == "not_creatable":
        dump, expected = Path("/proc/torchtitan_loom_run"), "cannot be created"
    else:
        ro = read_only_dir(tmp_path)
        dump, expected = ro, "is not writable"
    try:
        msg = errors_of("--job.dump_folder", str(dump))
    finally:
        if where == "read_only" and os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(dump)])
    assert f"job.dump_folder = '{dump}'" in msg and expected in msg


def test_cache_dir_not_writable(tmp_path):
    (tmp_path / "file").write_text("x")
    msg = errors_of(
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--data.path",
        "",
        "--data.cache_dir",
        str(tmp_path / "file" / "cache"),
    )
    assert f"data.cache_dir = '{tmp_path / 'file' / 'cache'}'" in msg and "is a file" in msg


def copy_pack(tiny_pack, tmp_path):
    dst = tmp_path / "pack"
    shutil.copytree(tiny_pack, dst)
    return dst


def truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 40)


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda p: truncate(p / "tokens.npy"), "tokens.npy is truncated or unreadable"),
        (
            lambda p: truncate(p / "epoch_0" / "doc_start.npy"),
            "epoch_0/doc_start.npy is truncated or unreadable",
        ),
        (
            lambda p: truncate(p / "epoch_1" / "doc_len.npy"),
            "epoch_1/doc_len.npy is truncated or unreadable",
        ),
        (lambda p: shutil.rmtree(p / "epoch_0"), "epoch_0 is missing"),
    ],
)
def test_damaged_pack_in_train_and_in_verify(tiny_pack, tmp_path, capsys, damage, expected):
    pack = copy_pack(tiny_pack, tmp_path)
    damage(pack)
    msg = errors_of(
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--data.path",
        str(pack),
        "--training.seq_len",
        "32",
    )
    assert msg.startswith("data.path: pack") and expected in msg and len(msg.splitlines()) == 1
    assert pack_tool.main(["--verify", str(pack)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_pack_vocabulary_larger_than_the_model(tmp_path):
    from torchtitan_loom.components.data.pack_writer import PackWriter

    out = tmp_path / "big_vocab"
    with PackWriter(
        out, {"vocab_size": 1000, "name_or_path": "wide", "eos_token_id": 999}, max_seq_len=33
    ) as w:
        for i in range(200):
            w.add_document(np.arange(i, i + 20, dtype=np.int64) % 999)
        w.finish(epochs=2, holdout_tokens=100, seed=0)
    msg = errors_of(
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--data.path",
        str(out),
        "--training.seq_len",
        "32",
    )
    # One line: the vocabulary check names the pack, the flavor's size and the override to use.
    assert len(msg.splitlines()) == 1, msg
    assert f"data.path='{out}'" in msg and "model.vocab_size = 512 (from the flavor 'debug')" in msg
    assert "--model.vocab_size 1024" in msg


def test_packer_names_the_non_utf8_line(tmp_path, capsys):
    jl = tmp_path / "bad.jsonl"
    jl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    assert pack_tool.main(["--jsonl", str(jl), "--out", str(tmp_path / "out")]) == 2
    assert f"{jl}:2: not valid UTF-8" in capsys.readouterr().err
    txt = tmp_path / "bad.txt"
    txt.write_bytes(b"one\n\ntwo \xff\n")
    assert pack_tool.main(["--text", str(txt), "--out", str(tmp_path / "out2")]) == 2
    assert f"{txt}:3: not valid UTF-8" in capsys.readouterr().err


def test_packer_read_only_out_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    ro = read_only_dir(tmp_path)
    try:
        code = pack_tool.main(
            ["--jsonl", str(tmp_path / "a.jsonl"), "--out", str(ro / "pack"), "--workers", "1"]
        )
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(ro)])
    err = capsys.readouterr().err
    assert code == 2 and f"--out '{ro / 'pack'}'" in err and "not writable" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_packer_broken_tokenizer_file(tmp_path, capsys):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(
        '{"version": "1.0", "model": {"type": "Nope"}}'
    )
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    pytest.importorskip("tokenizers")
    assert (
        pack_tool.main(
            [
                "--jsonl",
                str(tmp_path / "a.jsonl"),
                "--tokenizer",
                str(tmp_path / "tok"),
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        f"--tokenizer '{tmp_path / 'tok'}': cannot load it" in err
        and len(err.strip().splitlines()) == 1
    )


def test_cli_bad_inputs_exit_2_with_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan_loom.train",
            "--job.dump_folder",
            str(tmp_path / "r"),
            "--optimizer.lr",
            "nan",
            "--spike_guard.delta",
            "-1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "config error: optimizer.lr = nan: must be a finite number > 0",
        "config error: spike_guard.delta = -1.0: must be a finite number ≥ 0 "
        "(a threshold on the rise of the loss)",
    ]


# ------------------------------------------------------------------------------------ disk full
def argv(pack, dump, *extra):
    return [
        "--data.path",
        str(pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--training.steps",
        "4",
        "--training.mixed_precision_param",
        "float32",
        "--eval.interval",
        "0",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
        *extra,
    ]


def assert_disk_full_handled(dump, capsys, code):
    err = capsys.readouterr().err
    assert code == 1 and "checkpoint error: checkpoint step 4 not saved: no space left on" in err, (
        err
    )
    assert "Traceback" not in err
    root = dump / "checkpoint"
    found = tree.scan(str(root))
    assert [e.step for e in found.complete] == [2] and not found.incomplete
    assert integrity.verify(str(root / "step-2")) is None
    assert (
        json.loads((dump / "run.json").read_text())["status"] == "failed"
    )  # not left at "running"


def test_disk_full_during_save_on_a_small_tmpfs(tiny_pack, tmp_path, capsys):
    """A real full disk: a 24 MiB tmpfs holds one checkpoint of the debug model (~15 MB), not two."""
    dump = tmp_path / "small"
    dump.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(dump)], capture_output=True
    ).returncode:
        pytest.skip(
            "cannot mount a tmpfs here (needs root); the monkeypatched test below covers the logic"
        )
    try:
        code = train.main(argv(tiny_pack, dump))
        assert_disk_full_handled(dump, capsys, code)
    finally:
        subprocess.run(["umount", "-l", str(dump)])


def test_disk_full_during_save_reported_from_the_writer(tiny_pack, tmp_path, capsys, monkeypatch):
    """The writer fails the way torch's does on ENOSPC (a RuntimeError wrapping the OSError)."""
    from torchtitan_loom.components.checkpoint import saving

    real_save = saving.dcp.save

    def failing_save(sd, checkpoint_id, **kw):
        if str(checkpoint_id).endswith("step-4"):
            open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb").write(b"partial")
            raise RuntimeError("unexpected pos 704 vs 598") from OSError(
                errno.ENOSPC, "No space left on device"
            )
        return real_save(sd, checkpoint_id=checkpoint_id, **kw)

    monkeypatch.setattr(saving.dcp, "save", failing_save)
    code = train.main(argv(tiny_pack, tmp_path / "run"))
    assert_disk_full_handled(tmp_path / "run", capsys, code)
