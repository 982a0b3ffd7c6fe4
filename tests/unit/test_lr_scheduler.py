"""WSD / cosine lr schedule: LOOM_SPEC §7.1 table and §13 values, LambdaLR wiring, resume."""

import math

import pytest
import torch

from torchtitan_loom.components.optim.lr_scheduler import build_lr_scheduler, lr_scale

# Presets from LOOM_SPEC §1.2: (peak lr, T, warmup ratio, decay ratio, min ratio).
P329M = dict(total_steps=10_000, warmup_ratio=0.1, decay_ratio=0.1, min_ratio=0.1)
P1P7B = dict(total_steps=57_000, warmup_ratio=0.01, decay_ratio=0.1, min_ratio=0.1)

# lr values are products of a few floats; 1e-12 relative is far below any meaningful difference.
REL = 1e-12


@pytest.mark.parametrize(
    "step,lr",
    [
        (1, 2e-7),
        (999, 1.998e-4),
        (1000, 2e-4),
        (8999, 2e-4),
        (9000, 2e-4),
        (9500, 1.1e-4),
        (10_000, 2e-5),
    ],
)
def test_329m_values(step, lr):
    assert 2e-4 * lr_scale(step, **P329M) == pytest.approx(lr, rel=REL)


def test_1p7b_table():
    peak = 6e-5
    assert 6e-5 * lr_scale(1, **P1P7B) == pytest.approx(peak / 570, rel=REL)  # W_u = 570
    assert lr_scale(569, **P1P7B) == pytest.approx(569 / 570, rel=REL)
    assert lr_scale(570, **P1P7B) == 1.0
    assert lr_scale(51_300, **P1P7B) == 1.0  # decay window starts at 51300 with p = 0
    assert lr_scale(51_301, **P1P7B) < 1.0
    # Linear in the window: halfway (54150) is at 1 - 0.45.
    assert lr_scale(54_150, **P1P7B) == pytest.approx(0.55, rel=REL)
    assert peak * lr_scale(57_000, **P1P7B) == pytest.approx(6e-6, rel=REL)
    assert lr_scale(60_000, **P1P7B) == pytest.approx(0.1, rel=REL)  # holds past T


def test_cosine_endpoints():
    kw = dict(P329M, kind="cosine")
    assert lr_scale(1, **kw) == pytest.approx(1 / 1000, rel=REL)  # same warmup as WSD
    assert lr_scale(1000, **kw) == 1.0
    mid = 1000 + (10_000 - 1000) // 2
    assert lr_scale(mid, **kw) == pytest.approx(0.1 + 0.9 * 0.5, rel=REL)
    assert lr_scale(10_000, **kw) == pytest.approx(0.1, rel=REL)
    # Cosine decays from right after warmup (unlike WSD which is flat until T - D).
    assert lr_scale(2000, **kw) < 1.0 and lr_scale(2000, **P329M) == 1.0
    expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 1000 / 9000))
    assert lr_scale(2000, **kw) == pytest.approx(expected, rel=REL)


def test_bad_kind_names_valid_kinds():
    with pytest.raises(ValueError, match="wsd.*cosine"):
        lr_scale(1, **P329M, kind="linear")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="lr_scheduler.kind"):
        build_lr_scheduler(opt, **P329M, kind="step")


def _opt(peak):
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=peak)


def test_scheduler_sets_lr_per_global_step():
    opt = _opt(2e-4)
    sched = build_lr_scheduler(opt, **P329M, kind="wsd")
    # Before any step: lr of step 1.
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-7, rel=REL)
    for s in range(1, 1001):
        assert opt.param_groups[0]["lr"] == pytest.approx(2e-4 * lr_scale(s, **P329M), rel=REL)
        opt.step()
        sched.step()  # end of global step s


def test_state_dict_round_trip():
    kw = dict(total_steps=100, warmup_ratio=0.1, decay_ratio=0.2, min_ratio=0.1, kind="wsd")
    opt = _opt(1e-3)
    sched = build_lr_scheduler(opt, **kw)
    for _ in range(85):  # inside the decay window, where the lr changes every step
        opt.step()
        sched.step()
    saved = sched.state_dict()
    assert "lr_lambdas" in saved and saved["lr_lambdas"] == [None]  # closure is not saved

    opt2 = _opt(1e-3)
    sched2 = build_lr_scheduler(opt2, **kw)
    sched2.load_state_dict(saved)
    assert sched2.get_last_lr() == pytest.approx(sched.get_last_lr(), rel=REL)
    assert sched2.last_epoch == 85
    # The optimizer's lr is restored by its own state dict; the next scheduler step agrees anyway.
    opt.step()
    sched.step()
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"], rel=REL)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_scale(87, **kw), rel=REL)
