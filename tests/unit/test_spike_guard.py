"""Spike guard: §13 sanity values, §7.4 rule order, warmup, state round trips (plain and DCP)."""

import math
import warnings

import pytest
import torch.distributed.checkpoint as dcp

from torchtitan_loom.components.optim.divergence import non_finite_statistic
from torchtitan_loom.components.optim.spike_guard import SpikeGuard
from torchtitan_loom.config.schema import SpikeGuard as SpikeGuardSection


def _guard_with_base(base=3.0, segment=0, **kw):
    kw = {"enable" if k == "enabled" else k: v for k, v in kw.items()}
    g = SpikeGuard(SpikeGuardSection(**kw))
    g.accept(segment, base)  # the EMA starts at the first accepted loss
    return g


def test_spec_sanity_base_3():
    g = _guard_with_base(3.0)
    reason = g.check(0, 3.18, step=10)
    assert reason is not None and reason.startswith("adaptive")  # threshold max(0.18, 0.18)
    assert g.check(0, 3.17, step=10) is None


def test_first_seen_segment_accepted():
    g = _guard_with_base(3.0, segment=0)
    # Segment 1 has no baseline: even a huge loss is accepted.
    assert g.check(1, 50.0, step=10) is None


def test_the_non_finite_rule_has_one_owner():
    # The trainer asks divergence.non_finite_statistic before the guard, which sees finite losses only.
    assert non_finite_statistic(math.inf, 0.0) == "non-finite loss"
    assert non_finite_statistic(math.nan, 3.0) == "non-finite loss"
    assert non_finite_statistic(3.0, 1.0) == "non-finite gradient"
    assert non_finite_statistic(3.0, 0.0) is None


def test_rules_in_order():
    # hard: Δ ≥ 1.5 also satisfies ratio and adaptive; the hard rule must be reported.
    g = _guard_with_base(3.0)
    assert g.check(0, 4.5, step=10).startswith("hard")
    assert g.check(0, 4.49, step=10).startswith("ratio")
    # ratio before adaptive: base 1.0, loss 1.2 → ratio (1.09) and adaptive (0.18) both fire.
    g = _guard_with_base(1.0)
    assert g.check(0, 1.2, step=10).startswith("ratio")
    # adaptive only: base 10 → ratio at 10.9, adaptive at max(0.18, 0.6) = 0.6.
    g = _guard_with_base(10.0)
    assert g.check(0, 10.61, step=10).startswith("adaptive")
    assert g.check(0, 10.59, step=10) is None
    # Isolate each threshold by switching the others off.
    g = _guard_with_base(3.0, hard=1e9, ratio=1e9, rel=0.0, delta=0.5)
    assert g.check(0, 3.5, step=10).startswith("adaptive")
    assert g.check(0, 3.49, step=10) is None
    g = _guard_with_base(3.0, hard=0.1, ratio=1e9, delta=1e9)
    assert g.check(0, 3.1, step=10).startswith("hard")


def test_ema_update():
    g = SpikeGuard(SpikeGuardSection(noise_sigmas=0.0))  # the spec's fixed thresholds alone
    g.accept(0, 3.0)
    g.accept(0, 2.0)
    assert g.prev[0] == 2.0
    assert g.ema[0] == pytest.approx(0.9 * 3.0 + 0.1 * 2.0, abs=1e-15)
    # The baseline is the EMA (2.9), not prev (2.0): 2.9 + 0.18 is the adaptive limit.
    assert g.check(0, 3.07, step=5) is None
    assert g.check(0, 3.09, step=5).startswith("adaptive")
    # The noise is still measured: one change of 1.0 is σ = 1/√2 (its zero start's bias removed).
    assert g.noise(0) == pytest.approx(0.5**0.5)


def test_warmup_skips_nothing_but_still_names_the_breach():
    g = _guard_with_base(3.0, warmup_steps=100)
    assert g.check(0, 10.0, step=100) is None
    assert g.breach(0, 10.0).startswith("hard")  # a warm-up step that proves no checkpoint
    assert g.check(0, 10.0, step=101).startswith("hard")


def test_disabled_accepts_everything():
    g = _guard_with_base(3.0, enabled=False)
    assert g.check(0, 100.0, step=10) is None and g.breach(0, 100.0) is None


def test_bad_segment_index():
    with pytest.raises(ValueError, match="segment"):
        SpikeGuard(SpikeGuardSection()).check(-1, 1.0, step=1)


def _trajectory():
    """A loss sequence for three segments with a few spikes in it."""
    out = []
    for step in range(1, 30):
        for seg in range(3):
            loss = 5.0 - 0.05 * step - 0.3 * seg + (0.8 if step % 7 == 0 and seg == 1 else 0.0)
            out.append((step, seg, loss))
    return out


def _run(guard, items):
    decisions = []
    for step, seg, loss in items:
        r = guard.check(seg, loss, step)
        decisions.append(r)
        if r is None:
            guard.accept(seg, loss)
    return decisions


def test_state_round_trip_gives_identical_decisions():
    items = _trajectory()
    first, second = items[:40], items[40:]
    ref = SpikeGuard(SpikeGuardSection())
    ref_decisions = _run(ref, items)
    assert any(d is not None for d in ref_decisions[40:])  # the comparison covers skips

    g = SpikeGuard(SpikeGuardSection())
    _run(g, first)
    sd = g.state_dict()
    assert set(sd) == {"prev", "ema", "var", "n"} and all(isinstance(v, list) for v in sd.values())
    resumed = SpikeGuard(SpikeGuardSection())
    resumed.load_state_dict(sd)
    assert _run(resumed, second) == ref_decisions[40:]


def test_dcp_round_trip_into_fresh_guard(tmp_path):
    g = SpikeGuard(SpikeGuardSection())
    g.accept(0, 3.0)
    g.accept(2, 2.5)  # segment 1 never accepted: a hole in the lists
    g.accept(2, 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming single process" notice
        dcp.save({"spike_guard": g}, checkpoint_id=str(tmp_path))
        fresh = SpikeGuard(SpikeGuardSection())
        dcp.load({"spike_guard": fresh}, checkpoint_id=str(tmp_path))
    assert fresh.prev == g.prev and fresh.ema == g.ema
    assert fresh.var == g.var and fresh.n == g.n and fresh.noise(2) == g.noise(2) > 0
    assert 1 not in fresh.ema
