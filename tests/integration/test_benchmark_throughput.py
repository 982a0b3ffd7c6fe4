"""benchmarks/throughput.py: the CPU mode runs real Trainer steps and writes its JSON and table;
rejected configs become "unsupported" cells instead of failing the matrix."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "throughput.py"
TINY = [
    "--training.seq_len",
    "32",
    "--training.global_batch_size",
    "4",
    "--training.micro_batch_size",
    "4",
]


def load_script():
    spec = importlib.util.spec_from_file_location("throughput_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_cpu_mode_runs_and_writes_json_and_markdown(tmp_path, tiny_pack):
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--cpu",
        "--preset",
        "debug",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--precisions",
        "bf16,float8_tensorwise",
        "--compile",
        "off",
        "--ac",
        "none",
        "--out",
        str(out),
        "--data.path",
        str(tiny_pack),
        *TINY,
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="2"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "throughput_debug.json").read_text())
    meta, cells = result["meta"], result["cells"]
    assert meta["preset"] == "debug" and meta["cpu_mode"] and meta["seq_len"] == 32
    assert [(c["precision"], c["compile"], c["ac"]) for c in cells] == [
        ("bf16", "off", "none"),
        ("float8_tensorwise", "off", "none"),
    ]
    for c in cells:
        assert c["status"] == "ok", c
        assert c["tokens_per_s"] > 0 and c["tflops"] > 0 and c["peak_memory_gib"] > 0
        assert c["mfu"] is None  # CPU: no peak FLOP/s
        assert (
            c["flops_per_token"] == cells[0]["flops_per_token"]
        )  # same work counted for every precision
    table = (out / "throughput_debug.md").read_text()
    assert "| precision | compile | AC | status | tokens/s |" in table
    assert "| float8_tensorwise | off | none | ok |" in table


def test_rejected_config_is_an_unsupported_cell_and_cells_carry_their_flags(tmp_path):
    bench = load_script()
    args, overrides = bench.parse_args(["--cpu", "--preset", "debug", *TINY])
    argv = bench.cell_argv(args, overrides, "float8_rowwise", "on", "loop", tmp_path / "cell")
    assert argv[argv.index("--compile.enable") + 1] == "true"
    assert argv[argv.index("--activation_checkpoint.mode") + 1] == "loop"
    assert argv[argv.index("--float8.recipe") + 1] == "rowwise" and "--float8.emulate" in argv
    # tensor parallelism is rejected by the config validator: no process group, no tensor, a reason.
    cell = bench.run_cell(
        bench.cell_argv(
            args, [*overrides, "--parallelism.tp", "2"], "bf16", "off", "none", tmp_path / "tp"
        ),
        steps=1,
        warmup=0,
    )
    assert cell["status"] == "unsupported" and "parallelism.tp" in cell["reason"]
    meta = {
        "preset": "debug",
        "device_name": "cpu",
        "global_batch_size": 4,
        "seq_len": 32,
        "steps": 1,
        "warmup": 0,
        "torch": "x",
        "torchao": "y",
        "command": "c",
    }
    table = bench.markdown(meta, [dict(cell, precision="bf16", compile="off", ac="none")])
    assert "| bf16 | off | none | unsupported: parallelism.tp" in table
