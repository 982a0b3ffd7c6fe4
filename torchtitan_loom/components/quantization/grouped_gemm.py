"""The low-precision grouped GEMM the float8 converter hands to a model (protocols.GroupedKernel):
torchao's quantise-then-scaled-grouped-GEMM (torchao.prototype.moe_training) and the token-group
padding it needs. What the experts compute with it, and their weights' layout, is the model's own
(LOOM: models/loom/float8_experts.py, behind TrainSpec.float8_experts_fn); nothing here knows it.

Token-group alignment: float8 / MXFP8 grouped GEMMs need every expert's row count to be a multiple
of 16 / 32. `padded_rows` says where each row goes in a zero buffer whose groups start at aligned
offsets; the model copies its rows there, runs the GEMMs on the padded groups and reads the rows
back from the same positions; zero rows give zero outputs and add nothing to the weight gradients,
so padding changes no result. Shapes are static (the buffer size depends on A, E and the alignment
only) and no host sync is needed (emulated MXFP8 syncs inside torchao, on CPU only).

Legend: A rows (grouped by group/expert), P padded rows, K reduction dim, N output dim, E groups.
"""

from __future__ import annotations

import dataclasses

import torch

from torchtitan_loom.protocols import GroupedGemm, GroupedKernel


def padded_rows(
    counts_E: torch.Tensor, alignment: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each row goes in the padded buffer.

    Returns (dest_A: int64 padded row of each input row, ends_E: int32 group ends in the padded
    buffer, P: buffer rows). Every group starts at a multiple of `alignment` and holds
    ceil(count / alignment) blocks, at least one (empty experts get one zero block, so no kernel
    sees an empty group); the last group also takes the buffer's slack, so the groups tile all P
    rows. P = round_up(num_rows + E * alignment, alignment) bounds the total for any counts.
    """
    E = counts_E.numel()
    counts_E = counts_E.to(torch.int64)
    blocks_E = ((counts_E + alignment - 1) // alignment).clamp_min(1)
    padded_E = blocks_E * alignment
    P = -(-(num_rows + E * alignment) // alignment) * alignment
    ends_E = torch.cumsum(padded_E, 0)
    starts_E = ends_E - padded_E
    ends_E = torch.cat([ends_E[:-1], ends_E.new_full((1,), P)])
    src_starts_E = torch.cumsum(counts_E, 0) - counts_E
    expert_A = torch.repeat_interleave(
        torch.arange(E, device=counts_E.device), counts_E, output_size=num_rows
    )
    rows_A = torch.arange(num_rows, device=counts_E.device)
    dest_A = rows_A - src_starts_E[expert_A] + starts_E[expert_A]
    return dest_A, ends_E.to(torch.int32), P


def torchao_grouped_gemm(kernel: str) -> GroupedGemm:
    """torchao's quantise-then-scaled-grouped-GEMM for `kernel` (imported here, lazily)."""
    from torchtitan_loom.components.quantization.quiet_import import quiet_torchao_import

    with quiet_torchao_import():
        from torchao.prototype.moe_training.config import (
            Float8TrainingOpConfig,
            MXFP8TrainingOpConfig,
            MXFP8TrainingRecipe,
        )
        from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

    if kernel == "fp8_rowwise":
        base = Float8TrainingOpConfig(pad_token_groups_for_grouped_mm=False)
    elif kernel in ("mxfp8", "mxfp8_emulated"):
        recipe = (
            MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL
            if kernel == "mxfp8_emulated"
            else MXFP8TrainingRecipe.MXFP8_RCEIL
        )
        base = dataclasses.replace(
            MXFP8TrainingOpConfig.from_recipe(recipe), pad_token_groups_for_grouped_mm=False
        )
    else:
        raise ValueError(
            f"unknown float8 grouped-GEMM kernel {kernel!r}; valid: fp8_rowwise, mxfp8, mxfp8_emulated"
        )
    # bf16 output: the one dtype every kernel (and the emulated CPU path) produces.
    config = dataclasses.replace(base, out_dtype=torch.bfloat16)

    def gemm(a_PK: torch.Tensor, b_EKN: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
        return _quantize_then_scaled_grouped_mm(a_PK, b_EKN, config=config, offs=ends_E)

    return gemm


def grouped_kernel(
    kernel: str, alignment: int, dim_multiple: int, gemm: GroupedGemm | None = None
) -> GroupedKernel:
    """The GroupedKernel for torchao's `kernel` (or for `gemm`, e.g. a high-precision one in tests)."""

    def pad_rows(counts_E: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return padded_rows(counts_E, alignment, num_rows)

    return GroupedKernel(
        kernel, alignment, dim_multiple, gemm or torchao_grouped_gemm(kernel), pad_rows
    )
