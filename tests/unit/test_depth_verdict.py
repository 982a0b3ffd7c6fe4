"""The depth report's verdict on hand-computable curves (tools/depth_verdict.py): a point on the
fixed-depth line gets no credit, a point below it gets exactly the loops it saves beyond the named
fixed depth, the named depth is the fewest loops within 1% of the best fixed-depth loss, and the
README run's numbers (loops 1 / 2 / 3 = 0.8672 / 0.8310 / 0.8287, every KL point on the curve)
name fixed depth 2 and credit nothing. Also the settings that make the report read what the
run's held-out eval reads (tools/depth_settings.py)."""

import types

import pytest

from torchtitan_loom.tools.depth_settings import resolve
from torchtitan_loom.tools.depth_verdict import against_curve, baseline, curve_at, verdict

GFLOP_LOOP, GFLOP_HEAD = 1.0, 0.5  # per loop run, per head read (depth_run.FlopCount's split)


def fixed(*losses):
    return [
        {"loops": t, "loss": x, "gflops_per_token": t * GFLOP_LOOP + GFLOP_HEAD}
        for t, x in enumerate(losses, start=1)
    ]


def point(mean_loops, loss, criterion="kl", threshold=0.1):
    return {
        "criterion": criterion,
        "threshold": threshold,
        "mean_loops": mean_loops,
        "loss": loss,
        "gflops_per_token": mean_loops * (GFLOP_LOOP + GFLOP_HEAD),
    }


def judged(curve, H, *points):
    base = baseline(curve, H)
    adaptive = [{**p, **against_curve(p, curve, base)} for p in points]
    return adaptive, verdict(curve, H, adaptive)


def test_the_curve_is_linear_between_fixed_depths():
    assert curve_at([1, 2, 3], [1.0, 0.9, 0.8], 2.5) == pytest.approx(0.85)
    assert curve_at([1, 2, 3], [1.0, 0.9, 0.8], 1.0) == 1.0
    assert curve_at([1, 2, 3], [1.0, 0.9, 0.8], 3.2) is None


def test_a_point_on_the_fixed_line_gets_no_credit():
    # Depth 3 is the only one within 1% (0.808); a point halfway between 2 and 3 on the line.
    (on,), v = judged(fixed(1.0, 0.9, 0.8), 3, point(2.5, 0.85))
    assert on["curve_loss_at_loops"] == pytest.approx(0.85) and on["loops_saved"] == 0.0
    assert v["depth"] == 3 and v["best"] is None
    assert v["text"].startswith("no adaptive point beats the fixed-depth curve: fixed depth 3")


def test_a_point_on_the_line_within_the_tolerance_gets_no_credit():
    # Depth 2 (0.805) is within 1% of 0.80; on the line at 1.95 loops the loss is 0.80725 ≤ 0.808.
    on_line = curve_at([1, 2, 3], [0.85, 0.805, 0.8], 1.95)
    assert on_line == pytest.approx(0.80725)
    (on,), v = judged(fixed(0.85, 0.805, 0.8), 3, point(1.95, on_line))
    assert on["loss"] <= v["target_loss"] and not on["below_curve"] and on["loops_saved"] == 0
    assert v["best"] is None


def test_a_point_below_the_line_gets_exactly_the_loops_it_saves_beyond_the_named_depth():
    below = point(2.25, 0.805, threshold=0.03)  # curve there: 0.875; within 1% of 0.8
    beyond = point(2.5, 0.806, threshold=0.01)  # below too, but saves less
    (a, b), v = judged(fixed(1.0, 0.9, 0.8), 3, below, beyond)
    assert a["below_curve"] and a["loops_saved"] == pytest.approx(0.75)
    assert b["loops_saved"] == pytest.approx(0.5)
    assert v["depth"] == 3 and v["best"]["threshold"] == 0.03
    # 2.25 loops × 1.5 GFLOP = 3.375 against depth 3's 3.5: 4% fewer FLOPs.
    assert v["text"].startswith(
        "kl exit below 0.03: 2.25 loops per token, 0.75 fewer than fixed depth 3 (25%; forward "
        "FLOPs per token 4% fewer) at loss 0.8050, 8.00% below the fixed-depth curve; fixed "
        "depth 3 (loss 0.8000) is the best of depths 1..3"
    )


def test_depth_two_within_one_percent_is_named_and_a_point_past_it_saves_nothing():
    # The README run: depth 2 is within 1% of depth 3; KL points at 2.00..2.87 loops on the curve.
    curve = fixed(0.8672, 0.8310, 0.8287, 0.8300, 0.8350, 0.8400)
    kl = [point(2.0, 0.8308, threshold=1), point(2.5, 0.8305), point(2.87, 0.8314)]
    adaptive, v = judged(curve, 3, *kl)
    assert (v["depth"], v["best_depth"]) == (2, 3) and v["depth_loss"] == 0.8310
    assert all(a["loops_saved"] == 0 for a in adaptive) and v["best"] is None
    assert adaptive[0]["below_curve"]  # 0.8308 < 0.8310 at 2.00 loops, yet no fewer loops
    assert (
        "fixed depth 2 (loss 0.8310) is within 1% of the best fixed-depth loss 0.8287 (depth 3)"
        in (v["text"])
    )
    assert "(the cheapest within 1%: kl < 1, 2.00 loops, loss 0.8308)" in v["text"]
    # Below the curve at 1.5 loops and within 1%: credited 0.5 loops against depth 2, not 1.5 vs H.
    (p,), v = judged(curve, 3, point(1.5, 0.8330))
    assert (
        p["loops_saved"] == pytest.approx(0.5) and "0.50 fewer than fixed depth 2 (25%" in v["text"]
    )


def test_the_same_flops_comparison_uses_the_fixed_curve_on_the_flops_axis():
    # 2 loops adaptive cost 3.0 GFLOP = fixed depth 2.5 on the FLOPs axis (curve 0.85 there).
    (p,), _ = judged(fixed(1.0, 0.9, 0.8), 3, point(2.0, 0.9))
    assert p["curve_loss_at_loops"] == pytest.approx(0.9)
    assert p["curve_loss_at_flops"] == pytest.approx(0.85)


def run_config(**eval_kw):
    return types.SimpleNamespace(
        training=types.SimpleNamespace(seq_len=256, global_batch_size=16, micro_batch_size=8),
        eval=types.SimpleNamespace(tokens=50_000, batch_size=0, **eval_kw),
        data=types.SimpleNamespace(val_path=""),
    )


def test_the_default_reads_are_the_run_eval_and_every_override_is_named():
    flags = dict(data=None, tokens=None, seq_len=None, batch_rows=None, capacity="trained")
    reads = resolve(run_config(), "/p", "capacity_factor = 1.5", 512, **flags)
    assert (reads.tokens, reads.seq_len, reads.rows, reads.forward_rows) == (50_000, 256, 16, 8)
    assert reads.as_trained == "capacity_factor = 1.5" and reads.differs == ()
    assert reads.describe().startswith("Read as the run's held-out eval reads: 50,000 tokens")
    flags.update(tokens=20_000, capacity="off")
    reads = resolve(run_config(), "/p", "capacity_factor = 1.5", 512, **flags)
    assert reads.tokens == 20_000 and reads.as_trained == ""
    assert reads.differs == (
        "--capacity off: the model as decoding runs it (trained with capacity_factor = 1.5)",
        "--tokens 20000 (eval.tokens = 50000)",
    )


def test_a_validation_pack_is_read_as_the_eval_reads_it_and_a_data_override_is_named():
    flags = dict(data=None, tokens=None, seq_len=None, batch_rows=None, capacity="trained")
    cfg = run_config()
    cfg.data.val_path = "/val"
    reads = resolve(cfg, "/p", "capacity_factor = 1.5", 512, **flags)
    assert reads.val_path == "/val" and reads.source() == "epoch 0 of /val" and not reads.differs
    reads = resolve(
        cfg, "/p", "capacity_factor = 1.5", 512, **{**flags, "data": "/other", "batch_rows": 4}
    )
    assert reads.val_path is None and reads.source() == "the holdout of /other"
    assert reads.differs == (
        "--data /other (the eval reads epoch 0 of /val)",
        "--batch-rows 4 (training.micro_batch_size = 8)",
    )


def test_without_a_run_config_there_is_no_eval_to_match_and_it_says_so():
    flags = dict(data=None, tokens=None, seq_len=None, batch_rows=None, capacity="off")
    reads = resolve(None, "/p", "capacity_factor = 1.5", 512, **flags)
    assert (reads.tokens, reads.seq_len, reads.rows, reads.forward_rows) == (20_000, 512, 8, 8)
    assert reads.describe().endswith(
        "unlike the run's held-out eval: no config.toml next to the checkpoint, so no eval to "
        "match; --capacity off: the model as decoding runs it (trained with capacity_factor = 1.5)"
    )


def test_the_fixed_loops_of_equal_loss_read_the_falling_part_of_the_curve():
    # Loops 1..4: 1.0, 0.9, 0.8, 0.85 (depth 4 worse than 3: the best depth is 3).
    curve = fixed(1.0, 0.9, 0.8, 0.85)
    slow, fast, best, worse = (
        point(2.0, 0.85),  # the curve needs 2.5 loops for 0.85 (not 4: past the best depth)
        point(1.5, 0.9),  # 2 loops for 0.9: 25% fewer
        point(2.4, 0.79),  # below every fixed depth: measured against the best depth, 3
        point(1.0, 1.1),  # worse than one loop: no fixed depth of equal loss
    )
    a, b, c, d = judged(curve, 4, slow, fast, best, worse)[0]
    assert a["fixed_loops_same_loss"] == pytest.approx(2.5)
    assert a["fewer_loops_same_loss"] == pytest.approx(0.2)
    assert b["fixed_loops_same_loss"] == pytest.approx(2.0)
    assert b["fewer_loops_same_loss"] == pytest.approx(0.25)
    assert c["fixed_loops_same_loss"] == 3.0 and c["fewer_loops_same_loss"] == pytest.approx(0.2)
    assert d["fixed_loops_same_loss"] is None and d["fewer_loops_same_loss"] is None
