"""distributed/utils.py: gradient clipping and the replication count behind the multi-mesh norm."""

import os
import subprocess
import sys

import torch

from torchtitan_loom.distributed.utils import clip_grad_norm, grads_finite, reduce_gradients


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(3)]
    for p in params[:2]:
        p.grad = torch.randn(p.shape, generator=g) * 3
    return params  # the third has no gradient (a router outside the segment)


def test_clip_matches_torch_on_one_process():
    ours, theirs = _params(0), _params(0)
    norm = clip_grad_norm(ours, 1.0)
    want = torch.nn.utils.clip_grad_norm_([p for p in theirs if p.grad is not None], 1.0)
    assert abs(norm - want.item()) <= 1e-6 * want.item()
    for p, q in zip(ours[:2], theirs[:2]):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    assert ours[2].grad is None


def test_no_clip_at_zero_and_nothing_to_do_without_gradients():
    params = _params(1)
    before = [p.grad.clone() for p in params[:2]]
    norm = clip_grad_norm(params, 0.0)
    assert norm > 1.0 and all(torch.equal(p.grad, b) for p, b in zip(params, before))
    assert clip_grad_norm([torch.nn.Parameter(torch.ones(2))], 1.0) == 0.0
    reduce_gradients(params, torch.float32)  # one process: a no-op
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    params[0].grad[0, 0] = float("inf")
    assert not grads_finite(params)


COPIES_SCRIPT = r"""
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torchtitan_loom.distributed.utils import _copies
dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("r", "s"))
local = torch.zeros(2, 2)
def dt(m, placements):
    return DTensor.from_local(local, m, placements, run_check=False)
print(_copies(local, 8),                                        # plain: on every rank
      _copies(dt(mesh, [Replicate(), Shard(0)]), 8),            # HSDP: one shard on 2 replicas
      _copies(dt(mesh, [Shard(0), Shard(1)]), 8),               # owned once
      _copies(dt(mesh, [_StridedShard(0, split_factor=2), Shard(0)]), 8),  # FSDP over EP
      _copies(dt(mesh["s"], [Shard(0)]), 8),                    # a 4-rank sub-mesh, 2 copies of it
      _copies(dt(mesh["s"], [Replicate()]), 8))
"""


def test_replication_count_of_every_placement_kind():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", COPIES_SCRIPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["8", "2", "1", "1", "2", "8"]
