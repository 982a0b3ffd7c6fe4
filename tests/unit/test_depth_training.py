"""Depth training (training.sample_depth_min, depth_sampling.py): each step runs the first D loops,
D drawn per step from the segment ends ≥ the minimum as a pure function of (seed, step). Tested:
the step runs exactly the drawn segments (losses, counts, which routers get an update), a resume
draws the same depths and restores every state bit for bit, the depths vary and stay in range,
the FLOPs per token and the dry run's estimate use the expected depth, the run identity holds it,
and bad values are one config line each. Layout parity: tests/distributed/test_parallel_parity.py.
"""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import assert_same_state, make_trainer, run

from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.depth_sampling import DepthSampler, flops_per_token, sampler_of
from torchtitan_loom.protocols import segments

DEPTH = ("--training.bp_segment_len", "1", "--training.sample_depth_min", "1")


def test_draws_are_a_function_of_seed_and_step_and_cover_every_choice():
    segs = segments(9, 3)
    a, b = DepthSampler(segs, 4, seed=0), DepthSampler(segs, 4, seed=0)
    draws = [a.segments_at(s) for s in range(1, 201)]
    assert draws == [b.segments_at(s) for s in range(1, 201)]
    assert set(draws) == {2, 3}  # loop 3 ends before the minimum 4: never a depth
    assert draws != [DepthSampler(segs, 4, seed=1).segments_at(s) for s in range(1, 201)]
    assert a.mean_loops() == 7.5 and a.segment_weights() == [1.0, 1.0, 0.5]
    assert sampler_of(segs, 0, 0, 9) is None


def test_expected_flops_scale_the_loops_by_the_mean_depth_and_the_head_by_the_mean_segments():
    from torchtitan_loom.models.loom import LoomTransformer, loom_flavors

    with torch.device("meta"):
        model = LoomTransformer(loom_flavors["debug"].replace(num_loops=6))
    segs = segments(6, 2)
    sampler = DepthSampler(segs, 1, 0)  # 2, 4 or 6 loops: mean 4 loops, 2 segments
    no_head = model.flops_per_token(64, head_calls=0)
    head = model.flops_per_token(64, head_calls=1) - no_head
    want = no_head * 4 / 6 + head * 2
    assert flops_per_token(model, 64, segs, sampler) == pytest.approx(want, rel=1e-12)
    assert flops_per_token(model, 64, segs, None) == model.flops_per_token(64, head_calls=3)


def test_a_step_runs_exactly_the_drawn_segments(tiny_pack, tmp_path):
    trainer = make_trainer(tiny_pack, tmp_path, "--training.steps", "8", *DEPTH)
    sampler = trainer.parts.training.depth
    assert sampler is not None and sampler.choices == [1, 2, 3] and sampler.depths() == "1, 2 or 3"
    data = iter(trainer.dataloader)
    router_updates = torch.zeros(3, dtype=torch.int64)
    for step in range(1, 9):
        out = trainer.train_step(next(data))
        n = sampler.segments_at(step)
        assert len(out.seg_losses) == n
        ran = out.counts_LHE.sum(dim=(0, 2))  # kept assignments per loop
        assert (ran[:n] > 0).all() and (ran[n:] == 0).all()
        router_updates[:n] += 1
    # Loop t's router is stepped only on the steps that ran loop t (one AdamW step each).
    layer0 = trainer.model.layers[0].moe.routers
    got = [
        int(trainer.optimizer.state[r]["step"]) if r in trainer.optimizer.state else 0
        for r in layer0
    ]
    assert got == router_updates.tolist()
    assert len(set(sampler.segments_at(s) for s in range(1, 9))) > 1  # the depths varied


def test_resume_draws_the_same_depths_and_restores_every_state(tiny_pack, tmp_path):
    common = (
        "--training.steps",
        "6",
        "--checkpoint.interval",
        "3",
        "--checkpoint.keep_latest_k",
        "0",
        *DEPTH,
    )
    straight = run(make_trainer(tiny_pack, tmp_path, *common))
    resumed = make_trainer(tiny_pack, tmp_path, *common, "--checkpoint.load_step", "3")
    assert resumed.state.step == 3
    run(resumed)
    assert_same_state(straight, resumed)


def test_the_run_identity_holds_the_minimum(tiny_pack, tmp_path):
    run(
        make_trainer(tiny_pack, tmp_path, "--training.steps", "1", "--training.bp_segment_len", "1")
    )
    with pytest.raises(ConfigError, match=r"training.sample_depth_min: 0 → 1"):
        make_trainer(tiny_pack, tmp_path, "--training.steps", "2", *DEPTH)
    # A run.json written before the key existed reads as 0: that run still resumes.
    run_json = tmp_path / "run.json"
    record = json.loads(run_json.read_text())
    del record["identity"]["training.sample_depth_min"]
    run_json.write_text(json.dumps(record))
    resumed = make_trainer(
        tiny_pack, tmp_path, "--training.steps", "2", "--training.bp_segment_len", "1"
    )
    assert resumed.state.step == 1


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.sample_depth_min", "-1"], "training.sample_depth_min = -1: must be ≥ 0"),
        (
            ["--training.sample_depth_min", "4", "--training.bp_segment_len", "1"],
            "training.sample_depth_min = 4: at most 3 (model.num_loops",
        ),
        (
            ["--training.sample_depth_min", "1", "--training.bp_segment_len", "3"],
            "training.sample_depth_min = 1: only one depth is in [1, 3]",
        ),
    ],
)
def test_bad_minimum_is_one_config_line(argv, expected, tmp_path):
    with pytest.raises(ConfigError) as exc:
        resolve(load_config(["--job.dump_folder", str(tmp_path), *argv]), 1)
    assert expected in str(exc.value)


def test_dry_run_counts_the_expected_flops(tmp_path):
    from torchtitan_loom.distributed.estimate import estimate, report

    def est(*extra):
        cfg = load_config(
            [
                "--job.dump_folder",
                str(tmp_path),
                "--model.num_loops",
                "6",
                "--training.bp_segment_len",
                "2",
                *extra,
            ]
        )
        resolved = resolve(cfg, 1)
        return cfg, resolved

    cfg_full, r_full = est()
    cfg_depth, r_depth = est("--training.sample_depth_min", "1")
    full = estimate(cfg_full, r_full.model_args, r_full.dims)
    sampled = estimate(cfg_depth, r_depth.model_args, r_depth.dims)
    # Segments 1, 2, 3 run on 1, 2/3 and 1/3 of the steps: (1 + 2/3 + 1/3) / 3 of the full FLOPs
    # (every segment of this estimate costs the same: same loops, one head each).
    assert sampled.flops == pytest.approx(full.flops * 2 / 3, rel=1e-9)
    assert sampled.memory == full.memory
    assert any(
        "depth sampling" in line and "runs 2, 4 or 6 loops, 4.00 on average" in line
        for line in report(cfg_depth, r_depth.model_args, r_depth.dims)
    )


def test_run_json_records_the_model_sizes_and_each_launchs_seconds(tiny_pack, tmp_path):
    # What tools.compare reads instead of rebuilding the model: the trainer's own counts, with
    # the depth-sampled FLOPs, and the seconds of every launch that ended.
    trainer = run(make_trainer(tiny_pack, tmp_path, "--training.steps", "2", *DEPTH))
    record = json.loads((tmp_path / "run.json").read_text())
    counts = trainer.model.param_counts()
    assert record["model"] == {
        "params": counts["total"],
        "active_params": counts["active"],
        "flops_per_token": trainer.parts.training.flops_per_token,
    }
    assert trainer.parts.training.flops_per_token < trainer.model.flops_per_token(32, head_calls=3)
    (launch,) = record["launches"]
    assert record["status"] == "finished" and 0 < launch["seconds"] < 600 and "ended" in launch
