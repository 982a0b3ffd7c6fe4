"""Float8 routed experts under expert parallelism: EP 2 x FSDP 2 on 2 gloo ranks trains like one
process with the same float8 setting (emulated MXFP8 experts, emulated tensorwise dense linears).

One single-process reference run (in this process), then one 2-rank launch (parallel_workers.py,
the real Trainer) with two layouts: FSDP 2 alone and FSDP 2 x EP 2, both float8.

Tolerances, measured. Emulated MXFP8 quantises the forward and input-gradient GEMMs' operands per
row block, so a row's output depends on that row and the weights only: EP regroups rows across
ranks but quantises them as one process does (ep_workers.py: equal within fp32 summation order).
Only the weight-gradient GEMM quantises blocks of an expert's rows, which EP groups differently
(ep_workers.py: <= 4.3e-3 of the largest entry per layer). Step 1 starts from the same weights:
losses equal, grad norms 1.6e-7 relative, so STEP1_RTOL = 1e-5; running the experts' plain math
instead moves them by 8.9e-5 and 5.0e-4 (float8.experts = false on one process). After an
optimizer step the layouts' weights differ (those gradients, and summation order), and a quantiser
with 3 mantissa bits turns an element on a rounding boundary into a jump of up to 1/16: measured 3.0e-4 and 6.0e-4 on the
losses of steps 2 and 3 (FSDP 2 alone: 3.0e-4 and 3.5e-4 from EP), so every step within
MAX_RTOL = 2e-3; a layout defect such as gradients summed instead of averaged moves them by a
factor (test_parallel_parity.py).
"""

import importlib.util
import json

import parallel_workers  # next to this file (conftest puts it on sys.path for the spawned ranks)
import pytest
import torch

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.trainer import Trainer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao not installed"
)

STEPS = 3
STEP1_RTOL = 1e-5
MAX_RTOL = 2e-3
LAUNCHES = 48  # the limit, in bare-launch costs (tests/launch_cost.py)
FLOAT8 = ["--float8.enable", "--float8.emulate", "--float8.experts"]


def base_argv(pack_dir) -> list[str]:
    return [
        *("--data.path", str(pack_dir), "--training.seq_len", "32"),
        *("--training.global_batch_size", "8", "--training.micro_batch_size", "2"),
        *("--model.num_loops", "3", "--training.bp_segment_len", "3"),
        *("--training.mixed_precision_param", "float32", "--training.max_norm", "1.0"),
        *("--optimizer.eps", "1e-3", "--training.steps", str(STEPS)),  # eps: test_parallel_parity
        *("--metrics.enable_tensorboard", "false", "--eval.interval", "0"),
        *("--spike_guard.enable", "false", *FLOAT8),
    ]


def relative(got: list, want: list) -> torch.Tensor:
    a, b = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return ((a - b).abs() / b.abs()).flatten()


def test_float8_experts_under_ep2_x_fsdp_train_like_one_process(tiny_pack, tmp_path, launch_ranks):
    cfg = load_config(base_argv(tiny_pack) + ["--job.dump_folder", str(tmp_path / "one")])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = Trainer(
            cfg, resolve(cfg, 1), DistInfo(rank=0, world_size=1, device=torch.device("cpu"))
        )
        reference = parallel_workers.record_run(one, STEPS)
    finally:
        torch.set_num_threads(threads)
    assert reference["experts"][0] == ["Float8GroupedExperts"]

    cases = [
        {"name": "fsdp2", "argv": [], "steps": STEPS},
        {"name": "fsdp2_ep2", "argv": ["--parallelism.ep", "2"], "steps": STEPS},
    ]
    spec = {"base": base_argv(tiny_pack), "cases": cases, "out": str(tmp_path)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    launch_ranks(
        parallel_workers.run,
        2,
        (2, str(tmp_path / "store"), str(tmp_path / "spec.json")),
        LAUNCHES,
        "float8 under EP",
    )
    got = {c["name"]: json.loads((tmp_path / f"{c['name']}.json").read_text()) for c in cases}
    ep = got["fsdp2_ep2"]
    # The float8 experts really ran under EP: wrapped, not replaced.
    assert ep["experts"][0] == ["ExpertParallelExperts", "Float8GroupedExperts"], ep["experts"]
    assert ep["init_diff"] == 0.0
    for what in ("seg_losses", "grad_norms"):
        for name, want in (("one process", reference), ("FSDP 2 alone", got["fsdp2"])):
            rel = relative(ep[what], want[what])
            assert rel[0] <= STEP1_RTOL and rel.max() <= MAX_RTOL, (
                f"EP 2 x FSDP 2 vs {name}: {what} relative differences {rel.tolist()}"
            )
    assert ep["counts_by_step"][0] == reference["counts_by_step"][0], "kept counts of step 1"
