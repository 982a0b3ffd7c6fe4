"""Process-group init, small reductions, data-parallel gradient reduction and clipping.

Until FSDP2 lands (issue #5), several ranks each hold the whole model (the layout-independent init
makes the replicas identical without a broadcast) and sum their gradients with one all-reduce per
tensor; because the loss is already divided by the GLOBAL valid-token count, the sum is the mean
gradient whatever the world size.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def world_size_from_env() -> int:
    """The launcher's world size (torchrun sets WORLD_SIZE); 1 for a plain python run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(requested_device: str, timeout_s: float = 300.0) -> DistInfo:
    """Init nccl (CUDA) or gloo (CPU) when launched with several ranks; never without a timeout."""
    world = world_size_from_env()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(requested_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def set_determinism(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over the default group (no-op on one process); returns the tensor."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor


def reduce_gradients(params: list[torch.nn.Parameter], reduce_dtype: torch.dtype) -> None:
    """Sum gradients over data-parallel ranks in ``reduce_dtype`` (interim DP, see module doc).

    Every rank runs the same segment, so the same parameters have gradients everywhere (per-loop
    routers outside the segment have None on all ranks and are skipped consistently).
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    for p in params:
        if p.grad is None:
            continue
        g = p.grad if p.grad.dtype == reduce_dtype else p.grad.to(reduce_dtype)
        dist.all_reduce(g)
        if g is not p.grad:
            p.grad.copy_(g)


def grads_finite(params: list[torch.nn.Parameter]) -> bool:
    """True when every local gradient is finite, agreed by all ranks (one host sync)."""
    flags = [torch.isfinite(p.grad).all() for p in params if p.grad is not None]
    bad = torch.stack([~f for f in flags]).any().float() if flags else torch.zeros(())
    return all_reduce(bad.reshape(1), op="max").item() == 0.0


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of the existing gradients, clipped in place to max_norm (≤ 0: no clip)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    value = total.item()
    return value if math.isfinite(value) else float("nan")
