"""Layout-independent init (spec §3, §14): values by (seed, canonical name), meta build, wrappers,
DTensor shards."""

import math
import os
import subprocess
import sys

import pytest
import torch

from torchtitan_loom.models.loom import LoomTransformer, loom_flavors
from torchtitan_loom.models.loom.weight_init import init_generator_seed

DEBUG = loom_flavors["debug"]


def built(args=DEBUG) -> LoomTransformer:
    model = LoomTransformer(args)
    model.init_weights()
    return model


def state(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_meta_build_then_to_empty_and_init_equals_a_cpu_build():
    with torch.device("meta"):
        model = LoomTransformer(DEBUG)
    with pytest.raises(RuntimeError, match="meta device: call model.to_empty"):
        model.init_weights()
    model.to_empty(device="cpu")
    for m in model.moe_layers():
        m.expert_bias.fill_(float("nan"))  # to_empty leaves garbage; init must clear buffers too
    model.init_weights()
    want, got = state(built()), state(model)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_values_depend_on_name_and_seed_only():
    small, big = state(built()), state(built(DEBUG.replace(num_loops=9)))
    for name, value in small.items():  # same names -> same values whatever H is
        assert torch.equal(big[name], value), name
    other_seed = state(built(DEBUG.replace(init_seed=1)))
    assert not torch.equal(other_seed["output.weight"], small["output.weight"])
    assert not torch.equal(
        small["layers.0.attention.wqkv.weight"], small["layers.1.attention.wqkv.weight"]
    )


def test_generator_seeds_are_distinct_across_all_parameter_names_of_the_presets():
    for flavor in ("loom_329m", "loom_1p7b"):
        with torch.device("meta"):
            model = LoomTransformer(loom_flavors[flavor].replace(num_loops=12))
        names = [n for n, _ in model.named_parameters()]
        for seed in (0, 1, 1234):
            assert len({init_generator_seed(seed, n) for n in names}) == len(names)


def test_spec_3_init_table():
    model = built(DEBUG.replace(num_loops=9))
    d, inter = DEBUG.dim, DEBUG.expert_intermediate_size
    for layer in model.layers:
        r0 = layer.moe.routers[0]
        assert all(torch.equal(r, r0) for r in layer.moe.routers)  # exact copies of router 0
        assert r0.std().item() == pytest.approx(1 / math.sqrt(d), rel=0.1)  # 1024 samples
        assert torch.equal(layer.ffn_branch_norm.weight, torch.ones(d))
        assert not layer.moe.expert_bias.any()
    assert not torch.equal(model.layers[0].moe.routers[0], model.layers[1].moe.routers[0])
    truncated = {  # name: std; fmod-3 fold keeps |x| < 3 * 1.0148 * std
        "tok_embeddings.weight": 1 / math.sqrt(d),
        "output.weight": 1 / math.sqrt(d),
        "layers.0.attention.wqkv.weight": 1 / math.sqrt(d),
        "layers.0.attention.wo.weight": 1 / math.sqrt(d),
        "layers.0.moe.experts.w13": 1 / math.sqrt(d),
        "layers.0.moe.experts.w2": 1 / math.sqrt(inter),
        "layers.1.moe.shared_experts.1.w13.weight": 1 / math.sqrt(d),
        "layers.1.moe.shared_experts.1.w2.weight": 1 / math.sqrt(inter),
    }
    params = dict(model.named_parameters())
    for name, std in truncated.items():
        p = params[name]
        # >= 16k samples each: the sample std is within 3% of the target
        assert p.std().item() == pytest.approx(std, rel=0.03), name
        assert p.abs().max().item() < 3 * 1.014762601732121 * std, name


def test_activation_checkpointing_and_compile_keep_parameter_names():
    # init seeds and checkpoints key on parameter names: the wrappers must not add prefixes.
    from torchtitan_loom.distributed.activation_checkpoint import apply_activation_checkpointing
    from torchtitan_loom.distributed.model_wrappers import apply_compile

    args = loom_flavors["debug"]
    with torch.device("meta"):
        plain, wrapped = LoomTransformer(args), LoomTransformer(args)
    apply_activation_checkpointing(wrapped, "block", save_routing=True)
    apply_compile(list(wrapped.layers), backend="eager", fullgraph=True)
    assert list(dict(wrapped.named_parameters())) == list(dict(plain.named_parameters()))
    assert list(wrapped.state_dict()) == list(plain.state_dict())


DTENSOR_SCRIPT = r"""
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan_loom.models.loom import LoomTransformer, loom_flavors
args = loom_flavors["debug"]
reference = LoomTransformer(args)
reference.init_weights()
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
mesh = init_device_mesh("cpu", (2,))
with torch.device("meta"):
    model = LoomTransformer(args)
for layer in model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model.to_empty(device="cpu")
model.init_weights()
n = 0
for (name, p), q in zip(model.named_parameters(), reference.parameters()):
    assert type(p).__name__ == "DTensor", name
    assert torch.equal(p.to_local(), q.detach().chunk(2, dim=0)[1]), name
    n += 1
dist.destroy_process_group()
print("ok", n)
"""


def test_fsdp_sharded_init_gives_each_rank_its_shard_of_the_full_init():
    # Rank 1 of 2 (the shard that is not a prefix), FSDP2 over a fake process group: no
    # communication happens, so this runs on one CPU process. A subprocess keeps the process
    # group and device-mesh state out of the test session.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", DTENSOR_SCRIPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok", str(len(list(LoomTransformer(DEBUG).parameters())))]
