"""ParallelDims: degrees, one message per broken rule (at config time), meshes by name, dry run."""

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest

from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import parallelism_errors, resolve, resolve_model_args
from torchtitan_loom.distributed.parallel_dims import ParallelDims, parallelism_problems


def test_degrees_and_dp_shard_inference():
    dims = ParallelDims.create(dp_replicate=2, dp_shard=-1, ep=2, world_size=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.ep, dims.dp, dims.dp_shard_mod_ep) == (
        2,
        4,
        2,
        8,
        2,
    )
    assert dims.fsdp_enabled and dims.ep_enabled and dims.hsdp_enabled
    one = ParallelDims.create(world_size=1)
    assert (one.dp, one.dp_shard, one.fsdp_enabled, one.ep_enabled) == (1, 1, False, False)
    replicas = ParallelDims.create(dp_replicate=4, world_size=4)
    assert replicas.dp == 4 and not replicas.fsdp_enabled and not replicas.hsdp_enabled


def test_mesh_shapes_name_every_enabled_mesh():
    shapes = ParallelDims.create(dp_replicate=2, ep=2, world_size=8).mesh_shapes()
    assert shapes == {
        "dp": (("dp", 8),),
        "dp_replicate": (("dp_replicate", 2),),
        "dp_shard": (("dp_shard", 4),),
        "fsdp": (("dp_replicate", 2), ("dp_shard", 4)),
        "ep": (("ep", 2),),
        "dp_shard_mod_ep": (("dp_shard_mod_ep", 2),),
        "efsdp": (("dp_replicate", 2), ("dp_shard_mod_ep", 2)),
    }
    assert ParallelDims.create(world_size=4).mesh_shapes() == {
        "dp": (("dp", 4),),
        "dp_shard": (("dp_shard", 4),),
        "fsdp": (("dp_shard", 4),),
    }


def test_get_mesh_names_the_parallelism_to_enable():
    dims = ParallelDims.create(world_size=4)
    with pytest.raises(
        ValueError,
        match=r"mesh 'ep' does not exist: expert parallelism is not enabled "
        r"\(set parallelism.ep > 1\)",
    ):
        dims.get_mesh("ep")
    with pytest.raises(ValueError, match=r"HSDP.*parallelism.dp_replicate > 1"):
        dims.get_mesh("dp_replicate")
    assert dims.get_optional_mesh("ep") is None and dims.get_optional_mesh("efsdp") is None
    with pytest.raises(RuntimeError, match="build_meshes"):
        dims.get_mesh("fsdp")  # enabled, but no process group / meshes yet
    with pytest.raises(KeyError, match="unknown mesh 'tp'"):
        dims.get_mesh("tp")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=2), "parallelism.tp = 2: tensor parallel is not supported"),
        (dict(cp=2), "parallelism.cp = 2: context parallel is not supported"),
        (dict(pp=4), "parallelism.pp = 4: pipeline parallel is not supported"),
        (dict(dp_shard=0), "parallelism.dp_shard = 0: must be ≥ 1, or -1"),
        (dict(dp_replicate=3), "parallelism.dp_replicate = 3: must divide the world size 8"),
        (
            dict(dp_shard=2),
            "parallelism.dp_shard = 2: dp_replicate × dp_shard = 1 × 2 = 2 ranks, but the world size is 8",
        ),
        (dict(ep=3, num_experts=6), "parallelism.ep = 3: must divide dp_shard = 8"),
        (dict(ep=4, num_experts=6), "parallelism.ep = 4: must divide the 6 routed experts"),
    ],
)
def test_each_broken_rule_gives_one_message(kwargs, message):
    args = dict(dp_replicate=1, dp_shard=-1, ep=1, world_size=8) | kwargs
    problems = parallelism_problems(**args)
    assert len(problems) == 1 and problems[0].startswith(message), problems
    with pytest.raises(ValueError, match=message.split(":")[0]):
        ParallelDims.create(**args)


@pytest.mark.parametrize(
    "argv, world, expected",
    [
        # ep not dividing the debug flavor's 8 routed experts (and dp_shard fine): one line.
        (
            [
                "--parallelism.ep",
                "3",
                "--training.global_batch_size",
                "12",
                "--training.micro_batch_size",
                "2",
            ],
            6,
            "parallelism.ep = 3: must divide the 8 routed experts of the model; valid: [1, 2, 4, 8]",
        ),
        # The degrees do not multiply to the world size.
        (
            [
                "--parallelism.dp_replicate",
                "2",
                "--parallelism.dp_shard",
                "4",
                "--training.micro_batch_size",
                "2",
            ],
            4,
            "parallelism.dp_shard = 4: dp_replicate × dp_shard = 2 × 4 = 8 ranks, but the world size is 4; use 2 or -1",
        ),
        (
            [
                "--parallelism.ep",
                "2",
                "--parallelism.dp_shard",
                "1",
                "--parallelism.dp_replicate",
                "2",
                "--training.micro_batch_size",
                "2",
            ],
            2,
            "parallelism.ep = 2: must divide dp_shard = 1",
        ),
        (
            ["--training.global_batch_size", "8", "--training.micro_batch_size", "4"],
            4,
            "training.global_batch_size = 8: must be divisible by data-parallel ranks × micro_batch_size = 4 × 4",
        ),
        (
            ["--parallelism.dry_run_world_size", "4"],
            1,
            "parallelism.dry_run_world_size needs parallelism.dry_run",
        ),
    ],
)
def test_bad_layouts_fail_at_config_time_with_one_message(argv, world, expected):
    with pytest.raises(ConfigError) as exc:
        resolve(load_config(argv), world)
    assert str(exc.value).startswith(expected) and "\n" not in str(exc.value), str(exc.value)


def test_expert_rows_must_split_evenly_when_experts_are_fewer_than_fsdp_ranks():
    cfg = load_config(["--parallelism.ep", "2"])
    args = resolve_model_args(cfg)  # debug: 8 experts, D = 128, expert width 128
    # 32 ranks, ep 2: 4 experts per ep rank over 16 FSDP ranks -> FSDP splits rows (256 and 128).
    dims = ParallelDims.from_config(cfg.parallelism, 32, num_experts=args.num_routed_experts)
    assert parallelism_errors(cfg, dims, args) == []
    errors = parallelism_errors(
        cfg, dims, dataclasses.replace(args, expert_intermediate_size=4)
    )  # 8 rows / 16
    assert len(errors) == 1 and "FSDP splits expert rows" in errors[0], errors


def test_dry_run_lays_out_64_ranks_in_one_process():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torchtitan_loom.train",
        "--parallelism.dry_run",
        "--parallelism.dry_run_world_size",
        "64",
        "--parallelism.ep",
        "2",
        "--parallelism.dp_replicate",
        "2",
        "--training.global_batch_size",
        "128",
        "--training.micro_batch_size",
        "1",
        "--activation_checkpoint.mode",
        "loop",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "world 64 = dp_replicate 2 × dp_shard 32 (dp_shard = dp_shard_mod_ep 16 × ep 2)" in out
    assert "mesh efsdp            dp_replicate=2 × dp_shard_mod_ep=16" in out
    assert (
        "128 rows × 256 tokens per step = 2 rows per data-parallel rank (64 ranks) = 2 micro-batches of 1"
        in out
    )
    # Dense weights: HSDP (replicated over 2, sharded over 32); experts: 4 per ep rank, rows split over 16.
    assert "layers.0.attention.wqkv.weight  (384, 128) -> (12, 128)  R, S(0)" in out
    assert "layers.0.moe.experts.w13  (8, 256, 128) -> (4, 16, 128)  R, S(1), S(0)" in out
    assert "layers.0.moe.routers.0  (8, 128) -> (8, 128)  R" in out
    assert "estimate per rank" in out and "layers 1..1: same as layer 0" in out
    assert "recommended: --parallelism.dp_replicate" in out


def test_dry_run_rejects_a_bad_layout_before_building_anything():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torchtitan_loom.train",
        "--parallelism.dry_run",
        "--parallelism.dry_run_world_size",
        "6",
        "--parallelism.ep",
        "4",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert "config error: parallelism.ep = 4: must divide dp_shard = 6" in result.stderr


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_dry_run_converts_float8_experts_and_lays_them_out_under_ep():
    # The trainer's order (float8 converters on the meta model, then EP and FSDP around them), so
    # a float8 layout with EP is checked on a CPU machine before any GPU runs it (a one-GPU check
    # cannot: EP needs as many ranks as its degree).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1"}
    cmd = [sys.executable, "-m", "torchtitan_loom.train", "--parallelism.dry_run"]
    cmd += ["--parallelism.dry_run_world_size", "8", "--parallelism.ep", "2"]
    cmd += ["--float8.enable", "--float8.emulate", "--float8.experts"]
    cmd += ["--training.global_batch_size", "64"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "(dp_shard = dp_shard_mod_ep 4 × ep 2)" in out
    assert "2 routed-expert modules -> mxfp8_emulated grouped GEMM" in out
    # 4 experts per ep rank, FSDP over efsdp = 4: one expert per rank, names unchanged.
    assert "layers.0.moe.experts.w13  (8, 256, 128) -> (1, 256, 128)  _S(0, 2), S(0)" in out
