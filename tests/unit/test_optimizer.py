"""AdamW build (one group, None-grad skip, implementations) and the expert-bias update (§5.2, §13)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from torchtitan_loom.components.optim.optimizer import build_optimizer
from torchtitan_loom.config.schema import Optimizer
from torchtitan_loom.models.loom.expert_bias import update_expert_bias


class _Toy(nn.Module):
    """Shared weight + two per-loop routers, like a 2-loop LOOM layer in miniature."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4, bias=False)
        self.routers = nn.ParameterList([nn.Parameter(torch.randn(3, 4)) for _ in range(2)])
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x, loop):
        return (self.shared(x) @ self.routers[loop].T).square().mean()


def test_one_group_of_trainable_params_with_recipe_hparams():
    torch.manual_seed(0)
    m = _Toy()
    opt = build_optimizer(m, Optimizer(lr=2e-4))
    assert len(opt.param_groups) == 1
    g = opt.param_groups[0]
    assert [id(p) for p in g["params"]] == [id(m.shared.weight)] + [id(r) for r in m.routers]
    assert g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8 and g["weight_decay"] == 0.1
    assert g["lr"] == 2e-4 and g["foreach"] is True


@pytest.mark.parametrize("impl", ["foreach", "fused", "for-loop"])
def test_param_without_grad_is_untouched(impl):
    """A router whose loop is outside the segment has grad None: no step, no decay, no moments."""
    torch.manual_seed(0)
    m = _Toy()
    opt = build_optimizer(m, Optimizer(lr=1e-2, implementation=impl))
    before = m.routers[1].detach().clone()
    x = torch.randn(5, 4)
    for _ in range(3):  # three "segments", all using loop 0 only
        opt.zero_grad(set_to_none=True)
        m(x, loop=0).backward()
        assert m.routers[1].grad is None
        opt.step()
    assert torch.equal(m.routers[1].detach(), before)
    assert m.routers[1] not in opt.state
    assert int(opt.state[m.shared.weight]["step"]) == 3
    assert int(opt.state[m.routers[0]]["step"]) == 3


def test_implementations_agree():
    results = []
    for impl in ["foreach", "fused", "for-loop"]:
        torch.manual_seed(0)
        m = _Toy()
        opt = build_optimizer(m, Optimizer(lr=1e-2, implementation=impl))
        x = torch.randn(5, 4)
        for loop in (0, 1, 0):
            opt.zero_grad(set_to_none=True)
            m(x, loop=loop).backward()
            opt.step()
        results.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    # Same math, different kernels: fp32 rounding only (values are O(1), 3 steps).
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0], results[2], rtol=1e-5, atol=1e-6)


def test_bad_implementation_and_fused_on_unsupported_device():
    with pytest.raises(ValueError, match="optimizer.implementation.*foreach"):
        build_optimizer(_Toy(), Optimizer(lr=1e-3, implementation="apex"))
    with torch.device("meta"):
        meta_model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="fused.*meta"):
        build_optimizer(meta_model, Optimizer(lr=1e-3, implementation="fused"))


class _MoE(nn.Module):
    def __init__(self, n_experts):
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(n_experts))


def test_expert_bias_spec_sanity():
    layers = [_MoE(3), _MoE(3)]
    counts_LE = torch.tensor([[10, 20, 30], [5, 5, 5]])  # second layer perfectly balanced
    update_expert_bias(layers, counts_LE, lr=2e-3)
    assert torch.equal(layers[0].expert_bias, torch.tensor([2e-3, 0.0, -2e-3]))
    assert torch.equal(layers[1].expert_bias, torch.zeros(3))  # sign(0) = 0
    update_expert_bias(layers, counts_LE, lr=2e-3)  # accumulates
    assert torch.allclose(
        layers[0].expert_bias, torch.tensor([4e-3, 0.0, -4e-3]), atol=0, rtol=1e-6
    )


def test_expert_bias_exact_for_large_counts():
    # Loads 2^25 and 2^25 + 1: a float32 mean would round them together and give sign 0.
    big = 2**25
    layer = _MoE(2)
    update_expert_bias([layer], torch.tensor([[big, big + 1]]), lr=1.0)
    assert torch.equal(layer.expert_bias, torch.tensor([1.0, -1.0]))


def test_expert_bias_noop_and_shape_errors():
    layer = _MoE(3)
    update_expert_bias([layer], torch.tensor([[1, 2, 3]]), lr=0.0)
    assert torch.equal(layer.expert_bias, torch.zeros(3))
    with pytest.raises(ValueError, match="counts_LE must be"):
        update_expert_bias([layer, _MoE(3)], torch.tensor([[1, 2, 3]]), lr=1e-3)
    with pytest.raises(ValueError, match="E=4"):
        update_expert_bias([layer], torch.tensor([[1, 2, 3, 4]]), lr=1e-3)


def test_expert_bias_replicated_dtensor(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layer = _MoE(3)
        layer.expert_bias = distribute_tensor(torch.zeros(3), mesh, [Replicate()])
        update_expert_bias([layer], torch.tensor([[10, 20, 30]]), lr=2e-3)
        assert torch.equal(layer.expert_bias.full_tensor(), torch.tensor([2e-3, 0.0, -2e-3]))
        layer.expert_bias = distribute_tensor(torch.zeros(3), mesh, [Shard(0)])
        with pytest.raises(ValueError, match="replicated"):
            update_expert_bias([layer], torch.tensor([[10, 20, 30]]), lr=2e-3)
    finally:
        dist.destroy_process_group()
