"""Config input no check accepted before: values beyond what the code can use, a generated file of
a million keys, nesting, a FIFO or a huge file as the config, a NUL byte, terminal control bytes.
Each answers with bounded one-line problems (exit 2 from the command line), without waiting."""

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_loom.components.runtime.messages import shorten_line
from torchtitan_loom.config.manager import MAX_PROBLEMS, ConfigError, load_config
from torchtitan_loom.config.validate import resolve

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "train_configs" / "debug_model.toml")


def _problems(argv: list[str]) -> str:
    """Every problem load_config and resolve find (resolve runs only on a loadable config)."""
    with pytest.raises(ConfigError) as info:
        resolve(load_config(argv), 1)
    return str(info.value)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("training.seed", str(2**70), "training.seed = 1180591620717411303424: beyond a 64-bit"),
        ("training.seed", "-3", "training.seed = -3: must lie in [0, 2^63 - 1]"),
        ("eval.batch_size", str(10**18), "eval.batch_size = 1000000000000000000: "),
        ("training.global_batch_size", str(2**40), "is over 2^31 tokens in one batch"),
        ("comm.init_timeout_seconds", str(10**18), "must lie in [1, 604800]"),
        ("comm.train_timeout_seconds", "0", "comm.train_timeout_seconds = 0: must lie in [1, "),
        ("job.dump_folder", "out\x00put", "job.dump_folder = 'out\\x00put': contains a NUL byte"),
    ],
)
def test_values_beyond_what_the_code_can_use_are_refused(tmp_path, key, value, message):
    argv = ["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path / "run")]
    problems = _problems([*argv, f"--{key}", value])
    assert message in problems, problems


def test_a_generated_file_of_unknown_keys_prints_the_first_problems_and_a_count(tmp_path):
    # 100k keys fit under the size cap (a million would not); each costs a dictionary lookup, not a fuzzy match.
    config = tmp_path / "generated.toml"
    config.write_text("[training]\n" + "".join(f"k{i}=1\n" for i in range(100_000)))
    with pytest.raises(ConfigError) as info:
        load_config(["--job.config_file", str(config)])
    lines = str(info.value).splitlines()
    assert len(lines) == MAX_PROBLEMS + 1
    assert "did you mean" in lines[0] or "valid:" in lines[0]
    assert lines[-1] == f"... and {100_000 - MAX_PROBLEMS:,} more problems (fix these first)"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[training]\nseed = " + "[" * 50_000 + "]" * 50_000 + "\n", "nests values too deeply"),
        ("x = " + "{a=" * 5_000 + "1" + "}" * 5_000 + "\n", "nests values too deeply"),
        ("[" + ".".join(["a"] * 5_000) + "]\nx = 1\n", "line 1: a key of over 16 dotted parts"),
        ("[a.b.c.d.e]\nx = 1\n", "bad.toml': TOML table [a.b.c.d.e] is nested 5 deep"),
        ("[training]\n" + "k" * 300 + " = 1\n", "line 2: a key of 300 characters"),
        (
            "[training]\nsteps = 3\n" + "# padding\n" * 200_000,
            "is over 1 MiB; a config is a few KiB",
        ),
        ("[training]\nsteps = 3\n\xff", "is not UTF-8 text"),
    ],
)
def test_a_file_no_config_could_be_is_one_line(tmp_path, text, message):
    config = tmp_path / "bad.toml"
    config.write_bytes(text.encode("latin-1") if "\xff" in text else text.encode())
    with pytest.raises(ConfigError) as info:
        load_config(["--job.config_file", str(config)])
    assert message in str(info.value) and len(str(info.value).splitlines()) == 1, str(info.value)


def _two_gib() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _train(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.train", *argv],
        cwd=cwd,
        preexec_fn=_two_gib,  # the parser given the file grows past this (3 GB at 50,000 parts)
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # the answer comes before torch is imported: a hang, not a slow machine
    )


def test_a_fifo_as_the_config_file_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    proc = _train(["--job.config_file", str(fifo)], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"config error: job.config_file: '{fifo}' is not a regular file (a FIFO, device or folder)"
    ]


def test_terminal_control_bytes_in_an_echoed_value_are_escaped(tmp_path):
    proc = _train(["--training.steps", "\x1b[2J\x07ten"], tmp_path)
    assert proc.returncode == 2
    assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr
    assert "\\x1b[2J\\x07ten" in proc.stderr, proc.stderr
    assert shorten_line("a\rb\x9bc") == "a\\rb\\x9bc"


@pytest.mark.parametrize(
    "name, text, message",
    [  # as the campaign generated them: one dotted key of 50,000 parts (338 KB, under the size
        # cap), and 90,000 empty unknown sections; then the single empty unknown one
        (
            "parts.toml",
            ".".join(["a"] * 50_000) + " = 1\n",
            "line 1: a key of over 16 dotted parts",
        ),
        ("empty.toml", "".join(f"[s{i}]\n" for i in range(90_000)), "opens over 256 [tables]"),
        ("one.toml", "[s0]\n", "unknown section 's0'"),
        ("nested.toml", "[training]\n[training.s0]\n", "unknown key 'training.s0'"),
    ],
    ids=["dotted-key", "empty-sections", "empty-section", "empty-nested"],
)
def test_a_generated_config_is_one_line_naming_the_file_and_starts_no_run(
    tmp_path, outside, name, text, message
):
    config = outside.put(name, text)  # the user's folder: read, never written
    proc = _train(["--job.config_file", str(config)], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines[:3]
    assert name in lines[0] or "unknown" in lines[0]
    assert not (tmp_path / "outputs").exists()  # no default run started in the current folder
    outside.check()


def test_an_unknown_flavor_and_key_typos_are_named_in_one_run_before_torch(tmp_path):
    """The flavor table is torch-free, so the command line's first answer names the flavor with
    the typos (it used to come only on the next run, after fixing them)."""
    toml = tmp_path / "typos.toml"
    toml.write_text('[model]\nflavor = "debgu"\n[training]\nstepz = 3\n')
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.train", "--job.config_file", str(toml)]
        + ["--optimizer.lrr", "3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "importing torch" not in proc.stdout, proc
    assert [ln.split(";")[0] for ln in proc.stderr.splitlines()] == [
        "config error: unknown key 'training.stepz'",
        "config error: unknown key 'optimizer.lrr'",
        "config error: model.flavor: unknown flavor 'debgu' of 'loom'",
    ]
    alone = subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.train", "--model.flavor", "debgu"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert alone.returncode == 2 and "importing torch" not in alone.stdout, alone
    assert alone.stderr.startswith("config error: model.flavor: unknown flavor 'debgu'"), alone
