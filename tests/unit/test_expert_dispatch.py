"""Expert parallelism composes around whichever experts are installed (infra/expert_parallel.py):
the plain RoutedExperts, the float8 grouped experts (emulated MXFP8) and a kind the wrapper has
never seen. On a 1-rank ep mesh the dispatch moves no row anywhere, so the wrapped layer must give
the unwrapped layer's results, and the parameter names, state-dict keys and init stay the same.

One subprocess (a gloo group of 1; keeps process-group state out of the test session) runs every
check; the multi-rank dispatch itself is tests/distributed/test_expert_parallel.py and
test_float8_ep.py.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import copy, math, tempfile
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torchtitan_loom.components.quantization.grouped_gemm import grouped_kernel
from torchtitan_loom.models.loom import loom_flavors
from torchtitan_loom.models.loom.float8_experts import Float8GroupedExperts, convert_float8_experts
from torchtitan_loom.models.loom.infra.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from torchtitan_loom.models.loom.moe import LoomMoE, RoutedExperts, run_experts


class OneLayer(nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].moe = moe

    def moe_layers(self):
        return iter([self.moe])


class Doubled(RoutedExperts):
    # A kind EP has never seen: its own math on the weights it is given.
    def compute(self, x_AD, counts_E, w13_E2ID, w2_EDI, sizes_E=None):
        return 2 * run_experts(x_AD, counts_E, w13_E2ID, w2_EDI, "loop", sizes_E)


def layer(capacity_factor, kind):
    args = loom_flavors["debug"].replace(
        dim=64, n_heads=1, expert_intermediate_size=32, capacity_factor=capacity_factor
    )
    moe = LoomMoE(args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    if kind == "float8":
        convert_float8_experts(OneLayer(moe), grouped_kernel("mxfp8_emulated", 32, 32))
    elif kind == "doubled":
        plain = moe.experts
        moe.experts = Doubled(*plain.w13.shape[:1], 64, 32, "loop")
        moe.experts.load_state_dict(plain.state_dict())
    return moe


def run(moe):
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out, kept, _ = moe(x, moe.routers[0])
    (out * torch.linspace(-1, 1, 64)).sum().backward()
    w13, w2 = (getattr(moe.experts, n).grad for n in ("w13", "w2"))
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    return out.detach(), kept, x.grad, local(w13), local(w2)


def close(name, got, want, tol):
    err = (got.float() - want.float()).abs().max().item()
    bound = tol * want.float().abs().max().item()
    assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"


dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
kinds = {"plain": RoutedExperts, "float8": Float8GroupedExperts, "doubled": Doubled}
for kind, cls in kinds.items():
    for capacity_factor in (0.0, 1.0):
        ref = layer(capacity_factor, kind)
        assert type(ref.experts) is cls, type(ref.experts)
        wrapped = copy.deepcopy(ref)
        apply_expert_parallel(OneLayer(wrapped), mesh)
        tag = f"{kind} capacity_factor={capacity_factor}"
        # Composed, not replaced: the installed module is the wrapper's child, its math intact;
        # the weights are the wrapper's (sharded), under the same names.
        assert isinstance(wrapped.experts, ExpertParallelExperts), tag
        assert type(wrapped.experts.local) is cls, tag
        assert list(wrapped.experts.local.parameters()) == [], tag
        assert list(wrapped.state_dict()) == list(ref.state_dict()), tag
        assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in ref.named_parameters()]
        want, got = run(ref), run(wrapped)
        assert torch.equal(got[1], want[1]), f"{tag}: kept counts"
        if capacity_factor:  # the slot path must see dropped assignments and padding
            assert want[1].sum() < 2 * 12 * ref.top_k, f"{tag}: capacity dropped nothing"
        # The same per-row math on the same rows: capacity off in the same groups; on, the wrapper
        # takes the kept rows in fixed slots (zero padding) where one process groups every
        # assignment, dropped ones too. Measured: equal, except the loop over more rows (the
        # padded slots) in another summation order, <= 1e-7 of the largest entry.
        for name, i in (("output", 0), ("input grad", 2), ("w13 grad", 3), ("w2 grad", 4)):
            close(f"{tag} {name}", got[i], want[i], 1e-6)
        assert f"local_experts={ref.experts.w13.shape[0]}, ep=1" in repr(wrapped.experts)
dist.destroy_process_group()
print("ok", len(kinds))
"""


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_expert_parallel_wraps_plain_float8_and_unknown_experts():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["ok", "3"], result.stdout
