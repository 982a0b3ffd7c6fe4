"""Process-group init, determinism, small reductions, gradient reduction and clipping across meshes.

Gradients live in three forms: FSDP-sharded DTensors (FSDP2 reduce-scatters them itself, summed,
never averaged), replicated DTensors (the per-loop routers under FSDP, see
models/loom/infra/parallelize.py) and plain tensors (a replicated model without FSDP). Because the loss is
already divided by the GLOBAL valid-token count, every reduction here is a SUM over the
data-parallel ranks: the result is the mean gradient whatever the world size.
"""

from __future__ import annotations

import datetime
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_loom.distributed.choices import (  # noqa: F401  (re-exported: their users' names)
    COMPILE_BACKENDS,
    DEVICES,
    DTYPE_NAMES,
    FSDP_SYNC,
    RESHARD_AFTER_FORWARD,
)

# The package's one dtype table, config name or the tools' short name -> torch dtype: each name of
# choices.DTYPE_NAMES gets its dtype object (not looked up on torch by name, so a typo cannot
# resolve to another attribute; a name without an object is a KeyError at import).
DTYPES: dict[str, torch.dtype] = {
    name: {"bfloat16": torch.bfloat16, "float32": torch.float32}[name] for name in DTYPE_NAMES
}
SHORT_DTYPES = {DTYPE_NAMES[name]: dtype for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    device: torch.device


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
    device = pick_device(requested_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        except dist.DistError as exc:  # a peer that never came (or a store that is not there)
            raise PeersMissing(_missing_peers(exc, rank, world, timeout_s)) from None
    return DistInfo(rank=rank, world_size=world, device=device)


class PeersMissing(RuntimeError):
    """The process group did not form: a rank never joined within comm.init_timeout_seconds."""


def _missing_peers(exc: BaseException, rank: int, world: int, timeout_s: float) -> str:
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (
        f"the {world} ranks did not all join within {timeout_s:g} s (comm.init_timeout_seconds): "
        f"rank {rank} waited at {where} ({first}); start every node with the same MASTER_ADDR, "
        f"MASTER_PORT and NNODES, or look for the node that failed before joining"
    )


# What a collective raises when a peer's process is gone (gloo: its socket reset or closed; any
# backend: a timeout), besides torch's own DistError classes (store and NCCL failures).
_PEER_GONE = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "gloo/transport",
    "Timed out waiting",
    "NCCL communicator was aborted",
)


def lost_peer(exc: BaseException) -> str | None:
    """A short reason when ``exc`` is a collective that failed because a peer is gone (its process
    died, its host vanished or hung past the collective timeout), None for anything else."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    text = str(exc)
    if not (isinstance(exc, dist.DistError) or any(m in text for m in _PEER_GONE)):
        return None
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0] if text.strip() else "")
    first = first.split(". This is typically", 1)[0]
    return f"{type(exc).__name__}: {first[:200]}"


def group_timeout_s(group: dist.ProcessGroup | None = None) -> float:
    """The timeout (seconds) in effect on ``group`` (default: the world group), read back from its backend."""
    from torch.distributed.distributed_c10d import _get_default_group

    group = group or _get_default_group()
    backend = group._get_backend(group._device_types[0])
    return backend.options._timeout.total_seconds()


def mesh_groups(parallel_dims) -> list[dist.ProcessGroup]:
    """The process group of every dimension of every mesh that ParallelDims built."""
    return [
        mesh.get_group(i)
        for name in parallel_dims.mesh_shapes()
        if (mesh := parallel_dims.get_optional_mesh(name)) is not None
        for i in range(mesh.ndim)
    ]


def set_pg_timeouts(timeout_s: float, groups: list[dist.ProcessGroup]) -> list[float]:
    """Give the world group and ``groups`` a new collective timeout (TorchTitan's train timeout).

    A barrier first: a slow rank still in its init-time work (compile, checkpoint load) must not see a
    faster rank's collectives time out under the shorter value. Returns the timeouts read back.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return []
    from torch.distributed.distributed_c10d import _get_default_group, _set_pg_timeout

    dist.barrier()
    timeout = datetime.timedelta(seconds=timeout_s)
    every = [_get_default_group(), *groups]
    for group in every:
        _set_pg_timeout(timeout, group)
    return [group_timeout_s(g) for g in every]


def destroy_distributed(wait_for_all: bool = True) -> None:
    """Tear down the process group; after a normal finish, first wait for every rank.

    Rank 0 hosts the rendezvous store: a rank that leaves while another is still in its last
    collective can tear that rank's connections down mid-call (seen as SIGABRT at exit on gloo).
    After an error the barrier is skipped, since the other ranks may never reach it.
    """
    if dist.is_initialized():
        if wait_for_all and dist.get_world_size() > 1:
            dist.barrier()
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


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own piece: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def _is_replicated(t: torch.Tensor) -> bool:
    return not isinstance(t, DTensor) or all(p.is_replicate() for p in t.placements)


def _copies(t: torch.Tensor, world: int) -> int:
    """How many ranks of the world hold the same local piece as this rank (its replication)."""
    if not isinstance(t, DTensor):
        return world
    # Shard and FSDP's _StridedShard (EP + FSDP on one dim) both split; Replicate does not.
    sharded = math.prod(
        t.device_mesh.size(i)
        for i, p in enumerate(t.placements)
        if not (p.is_replicate() or p.is_partial())
    )
    return world // sharded


def reduce_gradients(
    params: Sequence[torch.Tensor],
    reduce_dtype: torch.dtype,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Sum over the data-parallel ranks every gradient that FSDP does not reduce, in ``reduce_dtype``.

    Plain gradients (no FSDP: every rank holds the whole model) are summed over ``group`` (default:
    all ranks, which are all data-parallel ranks); replicated DTensor gradients (the routers under
    FSDP) over their mesh; FSDP-sharded gradients are skipped, FSDP summed them already. One
    all-reduce per (group, dtype) bucket. Every rank runs the same segment, so the same parameters
    have gradients everywhere (routers outside the segment are None on all ranks and skipped).
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None or not _is_replicated(p.grad):
            continue
        groups: tuple[dist.ProcessGroup | None, ...]  # None: all ranks
        if isinstance(p.grad, DTensor):
            mesh = p.grad.device_mesh
            groups = tuple(mesh.get_group(i) for i in range(mesh.ndim) if mesh.size(i) > 1)
        else:
            groups = (group,)
        buckets.setdefault((groups, p.grad.dtype, p.grad.device), []).append(_local(p.grad))
    for (groups, _, _), grads in buckets.items():
        flat = torch.cat([g.reshape(-1).to(reduce_dtype) for g in grads])
        for g in groups:
            dist.all_reduce(flat, group=g)
        torch._foreach_copy_(
            grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)]
        )


def grads_finite(params: list[torch.nn.Parameter]) -> bool:
    """True when every gradient is finite on every rank (each rank checks its local pieces; one host sync)."""
    flags = [torch.isfinite(_local(p.grad)).all() for p in params if p.grad is not None]
    bad = torch.stack([~f for f in flags]).any().float() if flags else torch.zeros(())
    return all_reduce(bad.reshape(1), op="max").item() == 0.0


def grad_norm_sq_pieces(grads: list[torch.Tensor], world: int) -> torch.Tensor:
    """fp64 [G]: each gradient's squared L2 norm over its local piece, divided by the number of
    ranks holding that same piece, so one all-reduce SUM over all ranks gives the global norm²."""
    local = [_local(g) for g in grads]
    # fp64 accumulation: the total then rounds to the same fp32 value for any sharding.
    norms_G = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float64))
    copies_G = torch.tensor(
        [_copies(g, world) for g in grads], dtype=torch.float64, device=norms_G.device
    )
    return norms_G.square() / copies_G


def _scale_grads(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients in place by min(1, max_norm / (total + 1e-6)) (≤ 0: no clip), on the
    device, through their local tensors (a foreach kernel cannot mix DTensors of different meshes)."""
    if max_norm <= 0 or not grads:
        return
    local = [_local(g) for g in grads]
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for dtype in {g.dtype for g in local}:
        torch._foreach_mul_([g for g in local if g.dtype == dtype], scale.to(dtype))


class StepStatistics(NamedTuple):
    """One segment's statistics, summed over every rank (``step_statistics``)."""

    loss_sum: float
    """Summed token cross-entropy of the segment's last loop range."""
    grad_norm_sq: float
    """Squared global gradient norm, before clipping."""
    non_finite: float
    """Gradient pieces whose norm is not finite, on any rank (> 0: an inf or a NaN somewhere)."""
    stop_flag: float
    """Ranks that received a stop signal (> 0: every rank stops)."""
    n_valid: float
    """Valid target tokens of the global batch."""
    grad_norm_sq_t: torch.Tensor
    """``grad_norm_sq`` still on the device, for the clip (no second sync)."""


def step_statistics(
    params: Sequence[torch.Tensor],
    loss_sum: torch.Tensor,
    stop_flag: torch.Tensor,
    n_valid_t: torch.Tensor,
) -> StepStatistics:
    """The segment's ONE host sync: loss sum, gradient norm², non-finite flag and stop flag summed over
    all ranks by one small fp64 all-reduce, read together with the already reduced ``n_valid_t``.

    The norm² follows clip_grad_norm's rule (any mix of meshes). The flag counts gradient pieces
    whose norm is not finite, on any rank: exactly grads_finite's answer, since a piece's fp64 norm
    is finite iff all its fp32/bf16 values are. The spike guard and the clip
    (clip_grads_with_total_norm) both read the result.
    """
    grads = [p.grad for p in params if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    loss = loss_sum.detach().to(torch.float64).reshape(1)
    if grads:
        pieces_G = grad_norm_sq_pieces(grads, world)
        norm_sq = pieces_G.sum().reshape(1)
        non_finite = (~torch.isfinite(pieces_G)).sum().to(torch.float64).reshape(1)
    else:
        norm_sq = non_finite = torch.zeros(1, dtype=torch.float64, device=loss.device)
    flag = stop_flag.to(device=norm_sq.device, dtype=torch.float64).reshape(1)
    reduced = all_reduce(torch.cat([loss.to(norm_sq.device), norm_sq, non_finite, flag]))
    host = torch.cat([reduced, n_valid_t.to(reduced.device, torch.float64).reshape(1)]).tolist()
    loss_h, norm_sq_h, non_finite_h, flag_h, n_valid_h = host
    return StepStatistics(
        loss_h, norm_sq_h, non_finite_h, flag_h, n_valid_h, grad_norm_sq_t=reduced[1]
    )


def clip_grads_with_total_norm(
    params: Sequence[torch.Tensor], norm_sq: torch.Tensor, max_norm: float
) -> torch.Tensor:
    """Clip in place with a global norm² already reduced (step_statistics); returns the fp32 norm
    (0-d, on the device). No collective and no host sync."""
    total = norm_sq.sqrt().float().reshape(())
    _scale_grads([p.grad for p in params if p.grad is not None], total, max_norm)
    return total


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of the existing gradients, clipped in place to max_norm (≤ 0: no clip).

    Correct for any mix of meshes: each rank sums the squares of its local pieces, each divided
    by the number of ranks holding that same piece (1 for a shard owned once, the world size for a
    plain replicated gradient), and one all-reduce over all ranks adds them up. Same rule as
    torch.nn.utils.clip_grads_with_norm_: scale = min(1, max_norm / (norm + 1e-6)).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    world = dist.get_world_size() if dist.is_initialized() else 1
    total_sq = all_reduce(grad_norm_sq_pieces(grads, world).sum().reshape(1))
    total = total_sq.sqrt().float().reshape(())
    _scale_grads(grads, total, max_norm)
    value = total.item()
    return value if math.isfinite(value) else float("nan")
