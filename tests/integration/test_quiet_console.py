"""A quiet console (issue 35): library lines a user cannot act on do not reach it — torchao's
"Failed to load …/_C_*.so" lines and torch's pytree deprecation on the first float8 import, the
profiler's native USDT/STAGE lines at each trace window and its "clears events" warning — while
the project's own float8 and trace lines still say what the run does."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_float8_profiled_run_prints_only_lines_a_user_can_act_on(tmp_path):
    argv = [
        "--job.config_file",
        str(ROOT / "train_configs" / "debug_model.toml"),
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.steps",
        "2",
        "--eval.interval",
        "0",
        "--float8.enable",
        "true",
        "--float8.emulate",
        "true",
        "--profiling.enable_profiling",
        "true",
        "--profiling.profile_freq",
        "2",
        "--profiling.profiler_warmup",
        "1",
        "--profiling.profiler_active",
        "1",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.train", *argv],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for noise in ("Failed to load", "is an Enum subclass", "USDT:", "STAGE:", "clears events"):
        assert noise not in out, out
    assert "float8: 12 linears -> Float8Linear (tensorwise, emulated)" in out
    assert "profiler trace written:" in out and "iteration_2" in out
    # Nothing but the project's own lines.
    assert all(ln.startswith("[torchtitan_loom]") for ln in out.splitlines() if ln.strip()), out


def test_downstream_scoring_prints_its_own_lines_only(tmp_path):
    """lm-eval's --metadata hint, its tqdm bars and git's "not a git repository" (lm-eval records
    a commit hash; the run's working directory is no repository here) stay out of the console."""
    import pytest

    pytest.importorskip("lm_eval")
    argv = [
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.steps",
        "2",
        "--eval.interval",
        "0",
        "--eval.downstream_interval",
        "2",
        "--eval.downstream_tasks",
        "loom_tiny_mc",
        "--eval.downstream_tasks_dir",
        str(ROOT / "tests" / "inference" / "tiny_tasks"),
        "--eval.downstream_only_tasks_dir",
        "true",
        "--eval.downstream_limit",
        "8",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.train", *argv],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for noise in ("--metadata", "it/s]", "fatal: not a git repository"):
        assert noise not in out, out
    assert "downstream done in" in out and "loom_tiny_mc/acc " in out
    assert all(ln.startswith("[torchtitan_loom]") for ln in out.splitlines() if ln.strip()), out


def test_the_stderr_filter_drops_native_and_child_lines_and_keeps_the_rest(capfd):
    from torchtitan_loom.components.runtime.stderr_filter import dropping_stderr_lines

    with dropping_stderr_lines(lambda line: line.startswith("USDT:")):
        os.write(2, b"USDT: native\nkept from C\n")
        subprocess.run(["sh", "-c", "echo USDT: child >&2; echo kept from a child >&2"])
        print("kept from Python", file=sys.stderr)
    # (pytest's capture takes Python's own stderr writes directly, so only the set is compared)
    lines = capfd.readouterr().err.splitlines()
    assert sorted(lines) == ["kept from C", "kept from Python", "kept from a child"]
