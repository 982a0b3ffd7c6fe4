"""benchmarks/throughput.py --profile: two profiled Trainer steps per cell give a Chrome trace and
the share of step time in GEMMs, attention, all-to-all and other (benchmarks/step_profile.py)."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--training.seq_len",
    "32",
    "--training.global_batch_size",
    "4",
    "--training.micro_batch_size",
    "4",
]


def load_script():
    spec = importlib.util.spec_from_file_location(
        "throughput_bench", ROOT / "benchmarks" / "throughput.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_categories_of_cpu_and_cuda_names():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_profile import categorize

    assert categorize("aten::mm") == categorize("aten::_grouped_mm") == "gemm"
    assert categorize("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert categorize("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert categorize("flash_fwd_splitkv_kernel") == "attention"
    assert categorize("_c10d_functional::all_to_all_single") == "all_to_all"
    assert categorize("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "all_to_all"
    assert categorize("aten::add_") == categorize("aten::mul") == "other"


def test_profiled_cell_writes_a_trace_and_shares(tmp_path, tiny_pack):
    bench = load_script()
    args, overrides = bench.parse_args(
        ["--cpu", "--preset", "debug", "--profile", *TINY, "--data.path", str(tiny_pack)]
    )
    trace = tmp_path / "traces" / "cell.json"
    cell = bench.run_cell(
        bench.cell_argv(args, overrides, "bf16", "off", "none", tmp_path / "cell"),
        steps=1,
        warmup=1,
        trace=trace,
    )
    assert cell["status"] == "ok", cell
    shares = cell["profile"]
    assert abs(sum(shares[k] for k in ("gemm", "attention", "all_to_all", "other")) - 1.0) < 1e-9
    assert (
        shares["gemm"] > 0 and shares["attention"] > 0 and shares["all_to_all"] == 0
    )  # one process
    assert shares["step_time_s"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("name") == "aten::_grouped_mm" for e in events) > 0
    table = bench.markdown(
        {
            "preset": "debug",
            "device_name": "cpu",
            "global_batch_size": 4,
            "seq_len": 32,
            "steps": 1,
            "warmup": 1,
            "torch": "x",
            "torchao": None,
            "command": "c",
        },
        [{"precision": "bf16", "compile": "off", "ac": "none", **cell}],
    )
    assert "| bf16 | off | none |" in table and "GEMM %" in table
