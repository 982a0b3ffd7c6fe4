"""The start line's per-rank estimate (components/observability/progress.py): its parameter-state part is exact,
the step FLOPs follow the model's count, and on CPU the 329m preset in bf16 gets a warning up front
(never a refusal) while the debug run does not."""

import tempfile
from pathlib import Path

import torch

from torchtitan_loom.components.observability.progress import estimate_step, start_lines
from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.models.loom import LoomTransformer
from torchtitan_loom.protocols import get_train_spec, segments

CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"  # cwd-independent

CPU = torch.device("cpu")


def _estimate(argv, world=1):
    # A fresh dump folder: what ./outputs holds (the README's first run, say) is not this test's.
    with tempfile.TemporaryDirectory() as dump:
        cfg = load_config([*argv, "--job.dump_folder", dump])
        return _estimate_config(cfg, world)


def _estimate_config(cfg, world):
    args, dims = resolve(cfg, world)
    with torch.device("meta"):
        model = LoomTransformer(args)
    H = model.num_loops
    segs = segments(H, cfg.training.bp_segment_len)
    fpt = model.flops_per_token(cfg.training.seq_len, head_calls=len(segs))
    cost = get_train_spec("loom").cost_fn(args, dims, cfg)
    return cfg, model, estimate_step(cfg, dims, model.param_counts(), fpt, cost, H), fpt


def test_state_and_flops_follow_the_model():
    cfg, model, est, fpt = _estimate(["--job.config_file", f"{CONFIGS}/debug_model.toml"])
    n = sum(p.numel() for p in model.parameters())
    assert (
        est.params == n and abs(est.state_gib - 16 * n / 2**30) < 1e-12
    )  # fp32 param + grad + 2 moments
    t = cfg.training
    assert abs(est.step_tflop - fpt * t.global_batch_size * t.seq_len / 1e12) < 1e-12
    # FSDP over 4 ranks: a quarter of the state, a quarter of the step's rows per rank.
    _, _, est4, _ = _estimate(
        ["--job.config_file", f"{CONFIGS}/debug_model.toml", "--training.micro_batch_size", "4"],
        world=4,
    )
    assert (
        abs(est4.state_gib - est.state_gib / 4) < 1e-12
        and abs(est4.step_tflop - est.step_tflop / 4) < 1e-12
    )


def test_the_activation_term_is_the_dry_runs():
    # One activation model: the start line reads the same ModelCost as distributed/estimate.py.
    from torchtitan_loom.distributed.estimate import estimate

    argv = [
        "--job.config_file",
        f"{CONFIGS}/debug_model.toml",
        "--training.micro_batch_size",
        "2",
    ]
    cfg, _, est, _ = _estimate(argv)
    memory = estimate(cfg, *resolve(cfg, 1)).memory
    acts = sum(v for k, v in memory.items() if k.startswith(("activations", "logits", "carries")))
    assert est.activations_known and est.activation_gib * 2**30 == acts > 0


def test_329m_in_bf16_on_cpu_is_warned_not_refused():
    # dry_run: the estimate needs no data (the bundled corpus cannot serve this preset's seq_len).
    cfg, _, est, _ = _estimate(
        [
            "--job.config_file",
            f"{CONFIGS}/loom_329m.toml",
            "--training.mixed_precision_param",
            "bfloat16",
            "--parallelism.dry_run",
            "true",
        ],
        world=1,
    )
    lines = start_lines(cfg, est, CPU, rate_tflops=0.05)  # 50 GFLOP/s: a generous 2-core CPU
    assert lines[0].startswith("building loom/loom_329m: 313.86M parameters")
    assert (
        len(lines) == 2
        and lines[1].startswith("warning: one step of this config needs ~")
        and "it will run" in lines[1]
    )
    cfg, _, est, _ = _estimate(["--job.config_file", f"{CONFIGS}/debug_model.toml"])
    assert len(start_lines(cfg, est, CPU, rate_tflops=0.02)) == 1
