"""The dry run's cost estimate (distributed/estimate.py, comm_plan.py, models/loom/infra/cost.py): its
hardware keys are validated and change the result, its per-rank parameter count equals the shards
the parallelized model really holds, its FLOPs equal the trainer's formula, and its layout ranking
follows its own numbers. Collective counts: tests/distributed/test_estimate_comm.py; activation
memory: tests/integration/test_estimate_memory.py."""

import math
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed import comm_plan
from torchtitan_loom.distributed.estimate import estimate, recommend, report, seconds
from torchtitan_loom.protocols import get_train_spec, segments

BASE = [
    "--parallelism.dry_run",
    "--training.global_batch_size",
    "64",
    "--training.micro_batch_size",
    "2",
]


def resolved(argv: list[str], world: int):
    cfg = load_config(BASE + argv)
    return (cfg, *resolve(cfg, world))


@pytest.mark.parametrize(
    "key, value",
    [
        ("peak_tflops", "0"),
        ("achievable_fraction", "1.5"),
        ("intra_node_gbps", "-1"),
        ("inter_node_gbps", "nan"),
        ("gpus_per_node", "0"),
        ("latency_us", "-2"),
        ("memory_gib", "0"),
    ],
)
def test_bad_assumptions_are_config_errors_naming_the_key(key, value):
    cfg = load_config(BASE + [f"--estimate.{key}", value])
    with pytest.raises(ConfigError, match=f"estimate.{key} = "):
        resolve(cfg, 1)


def test_assumptions_are_printed_and_drive_the_step_time():
    cfg, args, dims = resolved(["--parallelism.dry_run_world_size", "16"], 16)
    slow = load_config(BASE + ["--estimate.peak_tflops", "100", "--estimate.inter_node_gbps", "5"])
    a, b = estimate(cfg, args, dims), estimate(slow, args, dims)
    assert b.compute_s == pytest.approx(a.compute_s * 989 / 100)
    assert b.overlapped_s > a.overlapped_s  # 16 ranks span two 8-GPU nodes: the network is the link
    text = "\n".join(report(slow, args, dims))
    assert "peak 100 TFLOP/s per GPU" in text and "5 GB/s between nodes" in text
    for part in (
        "gathered parameters",
        "activations of one micro-batch (none)",
        "logits",
        "all_gather",
        "reduce_scatter",
        "replicated parameters",
        "FLOPs per step",
        "MFU",
        "recommended:",
    ):
        assert part in text, part


def test_roofline_of_one_collective():
    hw = load_config([]).estimate
    c = comm_plan.Collective("all_reduce", "x", "dp", 4, 4, 3, 1_000_000)
    assert seconds(c, hw) == pytest.approx(3 * (15e-6 + 1e6 * 2 * 3 / 4 / 360e9))
    assert seconds(c._replace(span=16), hw) == pytest.approx(3 * (15e-6 + 1e6 * 2 * 3 / 4 / 45e9))


def test_flops_are_the_trainers():
    cfg, args, dims = resolved(["--model.num_loops", "9", "--training.bp_segment_len", "3"], 4)
    with torch.device("meta"):
        model = get_train_spec("loom").model_cls(args)
    n_seg = len(segments(args.num_loops, 3))
    rows = cfg.training.global_batch_size // dims.dp
    want = (
        model.flops_per_token(cfg.training.seq_len, head_calls=n_seg) * rows * cfg.training.seq_len
    )
    assert estimate(cfg, args, dims).flops == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    "argv, world",
    [
        # HSDP 2 × 6: no dimension of the debug model divides by 6, so FSDP pads every parameter.
        (
            [
                "--parallelism.dp_replicate",
                "2",
                "--model.vocab_size",
                "520",
                "--training.global_batch_size",
                "96",
            ],
            12,
        ),
        (["--parallelism.ep", "8"], 16),  # one expert per ep rank, FSDP splits expert rows
    ],
)
def test_parameters_per_rank_are_rank_0s_real_shards(argv, world):
    cfg, args, dims = resolved(argv + ["--parallelism.dry_run_world_size", str(world)], world)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        dims.build_meshes("cpu")
        spec = get_train_spec("loom")
        with torch.device("meta"):
            model = spec.model_cls(args)
        model = spec.parallelize_fn(model, dims, cfg).model
        local = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()
        )
    finally:
        dist.destroy_process_group()
    assert estimate(cfg, args, dims).memory["parameters (fp32)"] == 4 * local


def test_recommendation_is_the_fastest_layout_that_fits():
    cfg, args, dims = resolved(["--parallelism.dry_run_world_size", "16"], 16)
    lines = recommend(cfg, args, 16)
    best = [line for line in lines if line.startswith("  recommended:")][0]
    ranked = [
        float(line.split(": ")[1].split(" s per step")[0])
        for line in lines
        if " s per step, MFU" in line
    ]
    assert ranked == sorted(ranked) and len(ranked) == 3
    first = [line for line in lines if " s per step, MFU" in line][0]
    r, s, e = re.search(r"dp_replicate (\d+) × dp_shard (\d+), ep (\d+):", first).groups()
    assert f"dp_replicate {r} --parallelism.dp_shard {s} --parallelism.ep {e}," in best
    tiny = load_config(BASE + ["--estimate.memory_gib", "0.0001"])
    assert "nothing fits" in "\n".join(recommend(tiny, args, 16))


def test_a_single_process_has_no_collectives():
    cfg, args, dims = resolved([], 1)
    est = estimate(cfg, args, dims)
    assert est.collectives == [] and math.isclose(est.step_s, est.compute_s)


def test_float8_experts_under_ep_move_fp32_rows():
    # Float8 experts quantise the rows as they come (the fp32 residual stream), so EP moves them
    # in fp32; plain experts get bf16 rows (half the bytes). The counts exchange does not change.
    argv = ["--parallelism.dry_run_world_size", "4", "--parallelism.ep", "2"]
    argv += ["--training.mixed_precision_param", "bfloat16"]
    f8 = ["--float8.enable", "--float8.emulate", "--float8.experts"]
    moved = {}
    for name, extra in (("plain", []), ("float8", f8)):
        cfg, args, dims = resolved(argv + extra, 4)
        cost = get_train_spec(cfg.model.name).cost_fn(args, dims, cfg)
        moved[name] = dict((what, nbytes) for what, _, nbytes in cost.segment(1, 1).all_to_alls)
    assert moved["plain"]["experts dispatch"] > 0
    assert moved["float8"]["experts dispatch"] == 2 * moved["plain"]["experts dispatch"]
    assert moved["float8"]["experts counts"] == moved["plain"]["experts counts"]
