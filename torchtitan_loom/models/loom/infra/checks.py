"""LOOM's own config rules, run by config/validate.py before any process group exists: what its
attention backend needs installed (the spec's ``config_errors_fn``), and how FSDP may split its
routed experts under expert parallelism (``layout_errors_fn``, also asked of every layout the dry
run's estimate considers)."""

from __future__ import annotations

import importlib.util
from typing import Any

from torchtitan_loom.models.loom.args import LoomModelArgs


def config_errors(cfg: Any, args: LoomModelArgs, dims: Any) -> list[str]:
    """One line per problem of this LOOM model with this config (``dims`` None: degrees invalid)."""
    if args.attn_backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        return [
            "model.attn_backend = 'flash_attn': the flash-attn package is not installed "
            "(pip install flash-attn, CUDA only); use 'sdpa' or 'flex'"
        ]
    return []


def layout_errors(args: LoomModelArgs, dims: Any) -> list[str]:
    """One line per problem of this LOOM model laid out as ``dims`` (ParallelDims)."""
    errors: list[str] = []
    if dims.ep == 1:
        return errors
    # Fewer routed experts than FSDP ranks: FSDP shards each expert's rows (Shard(1)), which must be even.
    ep, efsdp = dims.ep, dims.dp_shard_mod_ep
    E, D, I = args.num_routed_experts, args.dim, args.expert_intermediate_size
    if E // ep < efsdp and (2 * I % efsdp or D % efsdp):
        errors.append(
            f"parallelism.ep = {ep}: with {E // ep} experts per ep rank and dp_shard / ep = "
            f"{efsdp} FSDP ranks per expert group, FSDP splits expert rows, which needs "
            f"model dim {D} and 2 × expert width {2 * I} divisible by {efsdp}; use a larger ep"
        )
    return errors
