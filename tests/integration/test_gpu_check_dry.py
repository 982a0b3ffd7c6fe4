"""benchmarks/gpu_check.sh --dry: the GPU check's own logic on a CPU (arguments, stage order, the
stop at the first failed stage with its log tail, the summary file), with CPU stand-in cells."""

import os
import subprocess
from pathlib import Path

import importlib.util

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STAGES = ["deps", "gpu_tests", "bf16_compiled", "float8_compiled", "bf16_eager"]


def run(*args, **env):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


def stage_rows(summary: str) -> list[tuple[str, str]]:
    stage_table = summary.split("Throughput:")[0]
    rows = [line.split("|")[1:3] for line in stage_table.splitlines() if line.startswith("| ")]
    return [(name.strip(), status.strip()) for name, status in rows if name.strip() in STAGES]


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "OUT_DIR missing"),
        (("--fast", "x"), "unknown option --fast"),
        (("a", "b"), "one OUT_DIR only"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(args, message):
    proc = run(*args)
    assert proc.returncode == 2 and message in proc.stderr


# The deps stage passes only where pytest, torchao and torchdata are importable (no wheels in CI).
needs_deps = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None or importlib.util.find_spec("torchdata") is None,
    reason="torchao or torchdata not installed",
)


@needs_deps
def test_dry_run_passes_every_stage_in_order_and_writes_the_summary(tmp_path):
    proc = run("--dry", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "cells.json",
        "env.txt",
        "gpu_check.log",
        "summary.md",
    ]
    summary = (out / "summary.md").read_text()
    assert "DRY RUN" in summary
    assert stage_rows(summary) == [(s, "ok") for s in STAGES]  # compiled cells before the eager one
    throughput_table = summary.split("Throughput:")[1]
    cells = [
        line.split("|")
        for line in throughput_table.splitlines()
        if line.startswith(("| bf16_", "| float8_"))
    ]
    assert [c[1].strip() for c in cells] == ["bf16_compiled", "float8_compiled", "bf16_eager"]
    assert all(
        float(c[3].replace(",", "")) > 0 and float(c[6]) > 0 for c in cells
    )  # tokens/s, peak memory
    assert "compiled / eager tokens/s (bf16):" in summary


@needs_deps
def test_dry_run_stops_at_the_first_failed_stage_with_its_log_tail(tmp_path):
    proc = run("--dry", "--skip-tests", str(tmp_path / "out"), BENCH_EXTRA="--model.num_loopz 3")
    assert proc.returncode == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert stage_rows(summary) == [
        ("deps", "ok"),
        ("bf16_compiled", "failed"),
    ]  # nothing after it ran
    assert "## Failed stage: bf16_compiled" in summary
    assert "model.num_loopz: not a key of model" in summary.split("## Failed stage")[1]
