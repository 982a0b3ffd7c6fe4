"""Loop schedules (gamma, g_t of spec §4.3) and the Looping-Residual closed form (spec §4.4, §13)."""

import pytest
import torch

from torchtitan_loom.models.loom import loom_flavors
from torchtitan_loom.models.loom.looping_residual import (
    Memory,
    ema_write,
    empty_memory,
    looping_residual_write,
)
from torchtitan_loom.models.loom.model import inject_gain, residual_gain

GAMMA_TABLE = {  # H: (L=10, L=15), spec §4.3
    1: (0.158114, 0.129099),
    3: (0.052705, 0.043033),
    6: (0.026352, 0.021517),
    9: (0.017568, 0.014344),
    12: (0.013176, 0.010758),
}
G_TABLE = {  # t: (L=10, L=15), spec §4.3
    2: (0.07906, 0.06455),
    3: (0.05270, 0.04303),
    4: (0.03953, 0.03227),
    5: (0.03162, 0.02582),
    6: (0.02635, 0.02152),
    7: (0.02259, 0.01844),
    8: (0.01976, 0.01614),
    9: (0.01757, 0.01434),
    10: (0.01581, 0.01291),
    11: (0.01437, 0.01174),
    12: (0.01318, 0.01076),
}


@pytest.mark.parametrize("H", sorted(GAMMA_TABLE))
def test_gamma_table(H):
    for flavor, expected in zip(("loom_329m", "loom_1p7b"), GAMMA_TABLE[H]):
        args = loom_flavors[flavor].replace(num_loops=H)
        assert residual_gain(args) == pytest.approx(expected, abs=5e-7)  # table has 6 decimals
        assert residual_gain(args.replace(cycle_residual_scale=False)) == 1.0


def test_injection_gain_table_is_independent_of_H():
    for t, row in G_TABLE.items():
        for flavor, expected in zip(("loom_329m", "loom_1p7b"), row):
            for H in (9, 12):
                assert inject_gain(t, loom_flavors[flavor].replace(num_loops=H)) == pytest.approx(
                    expected, abs=5e-6
                )
    args = loom_flavors["loom_329m"]
    assert inject_gain(9, args) == pytest.approx(residual_gain(args), rel=1e-12)  # g_H = gamma
    assert (
        inject_gain(1, args.replace(n_layers=1, cycle_scale_lambda=3.0)) == 1.0
    )  # clamped to [0, 1]


def test_constant_input_closed_form_of_spec_13():
    # o = u constant across all layers and loops: r_L = r_H = u, so every write is 2u, and the
    # denominators after 1, 2, 3 writes are 1, 1.5, 1.75.
    u = torch.randn(2, 3, 8)
    h_mem = empty_memory(u)
    h_dens = []
    for loop in range(3):
        l_mem = empty_memory(u)
        for layer in range(4):
            r, l_mem, h_mem = looping_residual_write(u, l_mem, h_mem, beta=0.5)
            torch.testing.assert_close(r, 2 * u, rtol=1e-6, atol=1e-6)
            if loop == 0 and layer < 3:
                assert torch.all(l_mem.den_BS1 == [1.0, 1.5, 1.75][layer])
            h_dens.append(h_mem.den_BS1[0, 0, 0].item())
    assert h_dens[:3] == [1.0, 1.5, 1.75]
    assert h_dens[-1] == pytest.approx(2 * (1 - 2.0**-12))  # D = 2(1 - 2^-n) after n writes
    assert l_mem.num_BSD.dtype == h_mem.num_BSD.dtype == torch.float32


def test_readout_is_the_normalised_ema_and_h_memory_cascades_from_r_L():
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(1, 2, 4, generator=g) for _ in range(5)]
    mem = empty_memory(values[0])
    for n, v in enumerate(values, start=1):
        mem, readout = ema_write(mem, v, beta=0.5)
        weights = [0.5 ** (n - i) for i in range(1, n + 1)]
        expected = sum(w * x for w, x in zip(weights, values[:n])) / sum(weights)
        torch.testing.assert_close(readout, expected, rtol=1e-6, atol=1e-6)
    # one write of o into empty memories: r_L = o, r_H = r_L, write = 2o (spec §4.4 closing note)
    o = values[0].to(torch.bfloat16)
    r, l_mem, h_mem = looping_residual_write(o, empty_memory(o), empty_memory(o), beta=0.5)
    assert r.dtype == torch.float32 and torch.equal(r, 2 * o.float())
    # the H memory is fed r_L, not o: second write of a different value
    o2 = values[1]
    r2, l2, h2 = looping_residual_write(o2, l_mem, h_mem, beta=0.5)
    r_L = (0.5 * o.float() + o2) / 1.5
    r_H = (0.5 * o.float() + r_L) / 1.5
    torch.testing.assert_close(r2, r_L + r_H, rtol=1e-6, atol=1e-6)


def test_beta_zero_keeps_only_the_last_write():
    mem = Memory(torch.full((1, 1, 2), 5.0), torch.full((1, 1, 1), 1.75))
    mem, readout = ema_write(mem, torch.ones(1, 1, 2), beta=0.0)
    assert torch.equal(readout, torch.ones(1, 1, 2)) and mem.den_BS1.item() == 1.0
