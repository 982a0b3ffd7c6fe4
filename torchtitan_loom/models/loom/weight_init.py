"""Layout-independent parameter init (LOOM_SPEC.md §3): every parameter is drawn from a CPU
generator seeded by (init_seed, its canonical name) on its FULL shape, then copied in (for a
DTensor only this rank's shard), so the initial weights do not depend on device, world size or
sharding. Router t >= 1 is drawn from router 0's seed: an exact copy.
"""

from __future__ import annotations

import math
import os
import re
import zlib
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from torchtitan_loom.models.loom.args import LoomModelArgs

TRUNC_NORMAL_GAIN = 1.014762601732121  # restores the std after the fmod-3 fold (spec §3)
INIT_THREADS = 8  # threads drawing init values (init_parameters), at most the CPU count


@torch.no_grad()
def init_parameters(named: Iterable[tuple[str, torch.Tensor]], args: LoomModelArgs) -> None:
    """Initialise every (canonical name, parameter) pair by the spec's table.

    The full CPU tensors are drawn by a few threads at once (each parameter has its own generator,
    so the values do not depend on the order): a CPU generator draws one value at a time, ~30 ns
    each, which is ~50 s for loom_1p7b's 1.6 B values on one core. The copies stay on this thread,
    in parameter order, with at most `workers` + 1 full tensors in memory."""
    named = list(named)
    for name, param in named:
        if param.is_meta:
            raise RuntimeError(
                f"parameter {name} is on the meta device: call model.to_empty(device=...) first"
            )
    workers = max(1, min(INIT_THREADS, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="loom-init") as pool:
        pending: deque = deque()
        for name, param in named:
            # Names are canonical: AC goes through region_wrappers and compile is per block in place.
            pending.append((param, pool.submit(_init_value, name, tuple(param.shape), args)))
            if len(pending) > workers:
                param_done, value = pending.popleft()
                _copy_full(param_done, value.result())
        while pending:
            param_done, value = pending.popleft()
            _copy_full(param_done, value.result())


_ROUTER = re.compile(r"^(layers\.\d+\.moe\.routers\.)\d+$")
_STD_BY_SUFFIX = (  # (name pattern, fan-in is the expert width?)
    (re.compile(r"^tok_embeddings\.weight$"), False),
    (re.compile(r"^output\.weight$"), False),
    (re.compile(r"^layers\.\d+\.attention\.(wqkv|wo)\.weight$"), False),
    (re.compile(r"^layers\.\d+\.moe\.experts\.w13$"), False),
    (re.compile(r"^layers\.\d+\.moe\.experts\.w2$"), True),
    (re.compile(r"^layers\.\d+\.moe\.shared_experts\.\d+\.w13\.weight$"), False),
    (re.compile(r"^layers\.\d+\.moe\.shared_experts\.\d+\.w2\.weight$"), True),
)


def _init_value(name: str, shape: tuple[int, ...], args: LoomModelArgs) -> torch.Tensor:
    """The full fp32 CPU init tensor of parameter `name` (spec §3 table)."""
    if re.fullmatch(r"layers\.\d+\.ffn_branch_norm\.weight", name):
        return torch.ones(shape)
    if re.fullmatch(r"exit_head\.(w_out\.(weight|bias)|w_in\.bias)", name):  # predicted gain 0
        return torch.zeros(shape)
    if name == "exit_head.w_in.weight":  # fan-in D + 2
        return _randn(name, shape, args.init_seed) / math.sqrt(shape[1])
    router = _ROUTER.match(name)
    if router:  # plain normal; every loop's router from router 0's seed => identical copies
        return _randn(router.group(1) + "0", shape, args.init_seed) / math.sqrt(args.dim)
    for pattern, fan_in_is_expert_width in _STD_BY_SUFFIX:
        if pattern.match(name):
            std = 1.0 / math.sqrt(
                args.expert_intermediate_size if fan_in_is_expert_width else args.dim
            )
            return _randn(name, shape, args.init_seed).fmod_(3.0).mul_(TRUNC_NORMAL_GAIN * std)
    raise ValueError(f"no init rule for parameter {name!r}; add one in models/loom/weight_init.py")


def init_generator_seed(init_seed: int, seed_name: str) -> int:
    """32-bit generator seed of one parameter (the CPU generator only uses 32 bits of a seed).

    zlib.crc32 is stable across processes, unlike Python's salted hash().
    """
    return zlib.crc32(f"{init_seed}:{seed_name}".encode())


def _randn(seed_name: str, shape: tuple[int, ...], init_seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(init_generator_seed(init_seed, seed_name))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full-shape `full` into `param`, or this rank's shard of it when param is a DTensor."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(param, DTensor):
            full = full.to(device=param.to_local().device, dtype=param.dtype)
            # src_data_rank=None: every rank holds the same full tensor, so no communication.
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
            return
    param.copy_(full)
