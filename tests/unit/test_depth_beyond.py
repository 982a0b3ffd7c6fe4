"""Depth past H (training.sample_depth_max, depth_sampling.py): a step's segments go on past the
model's H loops (H stays a segment end), the depth is drawn from the segment ends in [min or H, max],
and the loops past H run, and are trained, under the "last" router policy. Tested: the segments and
choices, a step that runs exactly the drawn loops with router H stepped once per segment that used
it, a resume bit for bit, the expected FLOPs of the estimate, the run identity, and bad values as
one config line each.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import assert_same_state, make_trainer, run

from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.depth_sampling import sampler_of, step_segments
from torchtitan_loom.protocols import segments

BEYOND = ("--training.bp_segment_len", "1", "--training.sample_depth_max", "6")


def test_segments_past_h_keep_h_a_segment_end_and_the_choices_start_at_h():
    assert step_segments(3, 2, 7) == [(1, 2), (3, 3), (4, 5), (6, 7)]
    assert step_segments(3, 0, 5) == [(1, 3), (4, 5)]
    assert step_segments(3, 1, 0) == segments(3, 1) == step_segments(3, 1, 3)
    segs = step_segments(3, 1, 6)
    sampler = sampler_of(segs, 0, 0, 3)
    assert sampler is not None and sampler.choices == [3, 4, 5, 6]  # min 0 = H: never shallower
    assert sampler.depths() == "3, 4, 5 or 6" and sampler.mean_loops() == 4.5
    assert sampler_of(segs, 2, 0, 3).choices == [2, 3, 4, 5, 6]  # type: ignore[union-attr]
    assert sampler_of(segments(3, 1), 0, 0, 3) is None


def test_a_step_trains_the_loops_past_h_under_router_h(tiny_pack, tmp_path):
    trainer = make_trainer(tiny_pack, tmp_path, "--training.steps", "8", *BEYOND)
    sampler = trainer.parts.training.depth
    assert sampler is not None and trainer.segments == step_segments(3, 1, 6)
    assert trainer.model.beyond_policy == "last"
    data = iter(trainer.dataloader)
    router_h_steps = 0
    for step in range(1, 9):
        out = trainer.train_step(next(data))
        n = sampler.segments_at(step)
        assert len(out.seg_losses) == n and out.skip_reason is None
        assert all(torch.isfinite(torch.tensor(out.seg_losses)))
        ran = out.counts_LHE.sum(dim=(0, 2))  # kept assignments per loop, 1..6
        assert ran.shape == (6,) and (ran[:n] > 0).all() and (ran[n:] == 0).all()
        router_h_steps += n - 2  # segments 3..n each use router H (loop 3, then "last")
    # Router H is stepped once per segment that ran a loop ≥ H; routers 1, 2 once per step.
    layer0 = trainer.model.layers[0].moe.routers
    got = [int(trainer.optimizer.state[r]["step"]) for r in layer0]
    assert got == [8, 8, router_h_steps] and router_h_steps > 8
    assert len({sampler.segments_at(s) for s in range(1, 9)}) > 1  # the depths varied


def test_resume_past_h_restores_every_state_bit_for_bit(tiny_pack, tmp_path):
    common = ("--training.steps", "6", "--checkpoint.interval", "3")
    common += ("--checkpoint.keep_latest_k", "0", *BEYOND)
    straight = run(make_trainer(tiny_pack, tmp_path, *common))
    resumed = make_trainer(tiny_pack, tmp_path, *common, "--checkpoint.load_step", "3")
    assert resumed.state.step == 3 and resumed.model.beyond_policy == "last"
    run(resumed)
    assert_same_state(straight, resumed)


def test_the_run_identity_holds_the_maximum(tiny_pack, tmp_path):
    run(
        make_trainer(tiny_pack, tmp_path, "--training.steps", "1", "--training.bp_segment_len", "1")
    )
    with pytest.raises(ConfigError, match=r"training.sample_depth_max: 0 → 6"):
        make_trainer(tiny_pack, tmp_path, "--training.steps", "2", *BEYOND)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.sample_depth_max", "-1"], "training.sample_depth_max = -1: must be ≥ 0"),
        (["--training.sample_depth_max", "2"], "training.sample_depth_max = 2: 0 or ≥ H = 3"),
        (
            ["--training.sample_depth_min", "7", *BEYOND],
            "training.sample_depth_min = 7: at most 6",
        ),
        (
            ["--training.sample_depth_min", "2", "--training.bp_segment_len", "3"],
            "training.sample_depth_min = 2: only one depth is in [2, 3]",
        ),
    ],
)
def test_bad_maximum_is_one_config_line(argv, expected, tmp_path):
    with pytest.raises(ConfigError) as exc:
        resolve(load_config(["--job.dump_folder", str(tmp_path), *argv]), 1)
    assert expected in str(exc.value) and "\n" not in str(exc.value)


def test_dry_run_counts_the_loops_past_h(tmp_path):
    from torchtitan_loom.distributed.estimate import estimate, report

    def est(*extra):
        cfg = load_config(
            ["--job.dump_folder", str(tmp_path), "--training.bp_segment_len", "1", *extra]
        )
        return cfg, resolve(cfg, 1)

    cfg_full, r_full = est()
    cfg_deep, r_deep = est("--training.sample_depth_max", "6")
    full = estimate(cfg_full, r_full.model_args, r_full.dims)
    deep = estimate(cfg_deep, r_deep.model_args, r_deep.dims)
    # Segments 1..6 (one loop and one head each) run on 1, 1, 1, 3/4, 2/4, 1/4 of the steps:
    # 4.5 segments on average against fixed H's 3.
    assert deep.flops == pytest.approx(full.flops * 4.5 / 3, rel=1e-9)
    assert any(
        "training.sample_depth_max = 6" in line and "runs 3, 4, 5 or 6 loops, 4.50" in line
        for line in report(cfg_deep, r_deep.model_args, r_deep.dims)
    )


def test_comm_plan_counts_the_deepest_step_past_h(tmp_path):
    from torchtitan_loom.distributed import comm_plan
    from torchtitan_loom.protocols import get_train_spec

    def plan(*extra):
        argv = ["--job.dump_folder", str(tmp_path), "--parallelism.dry_run"]
        cfg = load_config([*argv, "--training.bp_segment_len", "1", *extra])
        r = resolve(cfg, 2)
        cost = get_train_spec("loom").cost_fn(r.model_args, r.dims, cfg)  # type: ignore[misc]
        return {c.what: c for c in comm_plan.merged(comm_plan.predict(cfg, cost, r.dims, 3))}, cost

    fixed, cost = plan()
    deep, _ = plan("--training.sample_depth_max", "6")
    # One statistics all-reduce per segment (6 against 3), the step's counts one column per loop.
    assert fixed["step statistics"].calls == 3 and deep["step statistics"].calls == 6
    assert fixed["expert counts"].nbytes == cost.expert_counts * 8
    assert deep["expert counts"].nbytes == 2 * fixed["expert counts"].nbytes


def test_minimum_at_the_maximum_trains_every_loop_past_h_every_step(tiny_pack, tmp_path):
    # No draw, a recipe: each step runs (and trains) loops 1..6 of an H = 3 model.
    # (The spike guard off: two steps from init, a fresh loop's loss jumps past its ratio rule.)
    always = ("--training.sample_depth_min", "6", "--spike_guard.enable", "false", *BEYOND)
    trainer = make_trainer(tiny_pack, tmp_path, "--training.steps", "2", *always)
    assert trainer.parts.training.depth is None and trainer.segments[-1] == (6, 6)
    data = iter(trainer.dataloader)
    for _ in range(2):
        out = trainer.train_step(next(data))
        assert out.skip_reason is None, out.skip_reason
        assert len(out.seg_losses) == 6 and (out.counts_LHE.sum(dim=(0, 2)) > 0).all()
    model = trainer.model
    no_head = model.flops_per_token(32, head_calls=0)
    head = model.flops_per_token(32, head_calls=1) - no_head
    assert trainer.parts.training.flops_per_token == pytest.approx(
        no_head * 2 + head * 6, rel=1e-12
    )
