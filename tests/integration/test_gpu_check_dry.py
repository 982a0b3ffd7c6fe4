"""benchmarks/gpu_check.sh --dry: the GPU check's own logic on a CPU (arguments, stage order, a
failed stage recorded while the next ones run, OUT_DIR up to date after every stage, a kill at any
moment), with CPU stand-in cells."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STAGES = ["deps", "peak", "bf16_compiled", "bf16_eager", "float8_compiled", "gpu_tests"]
CELLS = ["bf16_compiled", "bf16_eager", "float8_compiled"]
KNOWN = [*STAGES, "float8_eager"]
OUT_FILES = ["cells.json", "env.txt", "gpu_check.log", "summary.md"]


def env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def run(*args, **extra):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=env(**extra),
    )


def stage_rows(summary: str) -> list[tuple[str, str]]:
    table = summary.split("| stage | status")[1].split("\n\n")[0]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| ")]
    return [(n.strip(), s.strip()) for n, s in rows if n.strip() in KNOWN]


def cell_rows(summary: str) -> dict[str, list[str]]:
    table = summary.split("| cell | status")[1].split("\n\n")[0]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()]
    return {r[0]: r for r in rows if r and r[0] in [*CELLS, "float8_eager"]}


@pytest.mark.parametrize(
    "args, extra, message",
    [
        ((), {}, "OUT_DIR missing"),
        (("--fast", "x"), {}, "unknown option --fast"),
        (("a", "b"), {}, "one OUT_DIR only"),
        (
            ("out",),
            {"TOTAL_S": "abc"},
            "TOTAL_S=abc: must be a whole number in [1, 9999999] of seconds",
        ),
        (("out",), {"STEPS": "0"}, "STEPS=0: must be a whole number in [1, 9999999]"),
        # 2^64 - 1: bash arithmetic would wrap it to -1 and run with no time at all.
        (("out",), {"TOTAL_S": str(2**64 - 1)}, f"TOTAL_S={2**64 - 1}: must be a whole number in"),
        (("out",), {"FAIL_STAGE": "bf16"}, "FAIL_STAGE=bf16: not a stage; valid: deps peak"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_and_leave_nothing(tmp_path, args, extra, message):
    work_parent = tmp_path / "tmp"
    work_parent.mkdir()
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=env(TMPDIR=str(work_parent), **extra),
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    if extra:  # the one-line errors (usage errors also print the usage)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not list(work_parent.iterdir())  # no work folder left behind
    assert not (tmp_path / "out").exists()  # checked before OUT_DIR is created


def test_an_out_dir_that_cannot_be_created_is_one_line_exit_2(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = run(str(blocker / "out"), TMPDIR=str(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"gpu_check: OUT_DIR {blocker / 'out'}: cannot create it"
    assert not any((d / "summary.md").exists() for d in (Path("/"), ROOT, tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]


def test_dry_run_runs_every_stage_in_order_and_reports_what_an_engineer_asks_first(tmp_path):
    out = tmp_path / "out"
    proc = run("--dry", str(out))
    # deps fails where torchdata is missing and no wheels are carried: recorded, the rest runs.
    assert proc.returncode in (0, 1), proc.stdout[-4000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == OUT_FILES
    summary = (out / "summary.md").read_text()
    assert "DRY RUN" in summary
    rows = stage_rows(summary)
    assert [n for n, _ in rows] == STAGES  # the cells first, compiled before eager, tests last
    assert all(s == "ok" for n, s in rows if n != "deps"), rows
    cells = cell_rows(summary)
    assert list(cells) == CELLS
    for row in cells.values():
        # tokens/s, MFU against the measured (stand-in) peak, warm-up time, step spread, memory
        assert float(row[2].replace(",", "")) > 0 and float(row[5]) > 0 and float(row[6]) > 0
        assert len(row[8].split(" / ")) == 3 and row[10].startswith("sdpa")
    records = json.loads((out / "cells.json").read_text())
    assert list(records) == sorted(CELLS)
    for rec in records.values():
        cell = rec["cells"][0]
        assert cell["status"] == "ok" and cell["measured_peak_tflops"] > 0
        for key in ("warmup_first_step_s", "step_time_median_s", "recompiles_in_timed_steps"):
            assert cell[key] is not None, key
    assert "compiled / eager tokens/s (bf16):" in summary and "Measured matmul peak" in summary


def test_a_failed_stage_is_recorded_and_the_next_stages_still_report(tmp_path):
    out = tmp_path / "out"
    proc = run("--dry", "--skip-tests", str(out), FAIL_STAGE="bf16_compiled")
    assert proc.returncode == 1
    summary = (out / "summary.md").read_text()
    rows = dict(stage_rows(summary))
    # float8 runs eager when the bf16 compile did not pass (a float8 compile would not fit either).
    assert rows["bf16_compiled"] == "failed" and "float8_compiled" not in rows
    assert rows["float8_eager"] == "ok"
    cells = cell_rows(summary)
    assert "bf16_compiled" not in cells  # it never ran
    assert float(cells["bf16_eager"][2].replace(",", "")) > 0
    assert float(cells["float8_eager"][2].replace(",", "")) > 0
    assert "float8 / bf16 tokens/s (eager):" in summary
    tail = summary.split("## bf16_compiled: failed")[1]
    assert "FAIL_STAGE=bf16_compiled: this stage fails at once" in tail


def test_a_cell_that_cannot_run_keeps_its_record_and_reason(tmp_path):
    out = tmp_path / "out"
    proc = run("--dry", "--skip-tests", str(out), BENCH_EXTRA="--model.attn_backend flash_attn")
    assert proc.returncode == 1
    records = json.loads((out / "cells.json").read_text())
    # bf16_compiled did not pass, so float8 ran eager (float8_eager).
    assert list(records) == ["bf16_compiled", "bf16_eager", "float8_eager"]
    for rec in records.values():
        cell = rec["cells"][0]
        assert cell["status"] == "unsupported" and "flash-attn" in cell["reason"]
    assert "unsupported: model.attn_backend = 'flash_attn'" in (out / "summary.md").read_text()


def test_killed_right_after_the_first_cell_out_holds_that_cell(tmp_path):
    """SIGKILL to the whole process group as soon as the first cell is reported: no trap, no
    final step; OUT must already name the cell with its tokens/s."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "--dry", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    try:
        for line in proc.stdout:
            if "bf16_compiled: ok" in line:
                break
            assert time.monotonic() < deadline, "the first cell never finished"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        # `timeout` puts each stage in a process group of its own: end the rest of the session
        # this test started (by its id), so no stage outlives the test.
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
    summary = (out / "summary.md").read_text()
    rows = dict(stage_rows(summary))
    assert rows["bf16_compiled"] == "ok" and rows["bf16_eager"] == "pending"
    assert float(cell_rows(summary)["bf16_compiled"][2].replace(",", "")) > 0
    assert "bf16_compiled" in json.loads((out / "cells.json").read_text())


def test_a_hanging_gpu_test_is_cut_by_its_own_alarm_and_the_next_one_runs(tmp_path):
    """tests/gpu/conftest.py's per-test alarm (GPU_TEST_S), on a copy of it next to a test that
    sleeps past it."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "gpu" / "conftest.py").read_text())
    (tmp_path / "test_hang.py").write_text(
        "import time\n\n"
        "def test_hangs():\n    time.sleep(60)\n\n"
        "def test_after_it():\n    assert True\n"
    )
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env(GPU_TEST_S="2"),
    )
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "1 failed, 1 passed" in proc.stdout and "ran past GPU_TEST_S=2 s" in proc.stdout
    assert time.monotonic() - started < 50


def test_a_cell_cut_after_its_first_warm_up_step_says_how_far_it_got(tmp_path):
    """HANG_STAGE: the compiled bf16 cell (dry: dynamo's eager backend) hangs after its first
    warm-up step, which compiled its graphs; the watchdog's SIGTERM at the stage's limit makes it
    write its record (the warm-up time, each graph compile's time, where it was cut), which the
    parent copies and judges. A grandchild that ignores SIGTERM (left by the peak stage through a
    PYTHON wrapper) is killed when its stage ends, though its shell exited long before."""
    leftover = tmp_path / "leftover.pid"
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == benchmarks/matmul_peak.py ]]; then\n'
        f"  (trap '' TERM; exec sleep 900) & echo $! > {leftover}\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    out = tmp_path / "out"
    started = time.monotonic()
    proc = run(
        "--dry", "--skip-tests", str(out), HANG_STAGE="bf16_compiled", TOTAL_S="90",
        PYTHON=str(wrapper),
    )  # fmt: skip
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    pid = int(leftover.read_text())
    assert not Path(f"/proc/{pid}").exists(), "the peak stage's grandchild outlived its stage"
    summary = (out / "summary.md").read_text()
    assert dict(stage_rows(summary))["bf16_compiled"] == "timed out", summary
    cell = json.loads((out / "cells.json").read_text())["bf16_compiled"]["cells"][0]
    assert cell["status"] == "timed out" and "during hang" in cell["reason"], cell
    assert len(cell["warmup_step_times_s"]) == 1 and cell["warmup_step_times_s"][0] > 0
    assert cell["steps_done"] == 1 and cell["build_s"] > 0
    assert cell["graphs_compiled"] >= 1 and len(cell["compile_times_s"]) >= 1, cell
    assert "Cells that did not finish" in summary and "1 steps done" in summary
    assert took < 90 + 30, took
    # No stage process is left: the hanging cell died with its process group.
    assert not subprocess.run(
        ["pgrep", "-f", "--", "--hang-after-step"], capture_output=True
    ).stdout
