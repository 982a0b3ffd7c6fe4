"""Routed experts with a low-precision grouped GEMM (torchao.prototype.moe_training).

`Float8GroupedExperts` replaces a layer's `moe.experts` (RoutedExperts) and keeps its contract:
forward(x_AD grouped by expert, counts_E) -> out_AD, the same SwiGLU per expert, the same w13 /
w2 parameters (names and shapes, so checkpoints load either way). Only the GEMMs change.

Token-group alignment is owned here, at the expert-call seam: float8 / MXFP8 grouped GEMMs need
every expert's row count to be a multiple of 16 / 32. Each group is copied into a zero buffer at
an aligned start, the GEMMs run on the padded groups, and the rows are read back from the same
positions; zero rows give zero outputs and add nothing to the weight gradients, so padding changes
no result. Shapes are static (the buffer size depends on A, E and the alignment only) and no host
sync is needed (emulated MXFP8 syncs inside torchao, on CPU only).

Legend: A assignment rows (grouped by expert), P padded rows, D model dim, I expert width,
E routed experts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from torchtitan_loom.models.loom.swiglu import swiglu_activation

GroupedGemm = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]  # (a_PK, b_EKN, ends_E)


def padded_layout(
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


def swiglu_grouped(
    x_AD: torch.Tensor,
    counts_E: torch.Tensor,
    w13_E2ID: torch.Tensor,
    w2_EDI: torch.Tensor,
    gemm: GroupedGemm,
    alignment: int,
) -> torch.Tensor:
    """W_d (silu(W_g x) * W_u x) per expert group, through `gemm` on alignment-padded groups."""
    A, D = x_AD.shape
    dest_A, ends_E, P = padded_layout(counts_E, alignment, A)
    x_PD = x_AD.new_zeros(P, D).index_copy(0, dest_A, x_AD)
    # Weights stay [E, out, in]; the kernels take the transposed (column-major) view.
    h_P2I = gemm(x_PD, w13_E2ID.transpose(-2, -1), ends_E)
    y_PD = gemm(swiglu_activation(h_P2I), w2_EDI.transpose(-2, -1), ends_E)
    return y_PD.index_select(0, dest_A)


def torchao_grouped_gemm(kernel: str) -> GroupedGemm:
    """torchao's quantise-then-scaled-grouped-GEMM for `kernel` (imported here, lazily)."""
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


class Float8GroupedExperts(nn.Module):
    """RoutedExperts' parameters (w13 [E, 2I, D], w2 [E, D, I]) with a low-precision grouped GEMM."""

    def __init__(
        self, experts: nn.Module, kernel: str, alignment: int, gemm: GroupedGemm | None = None
    ):
        super().__init__()
        self.w13 = experts.w13  # the same Parameter objects: names, shapes and init rules unchanged
        self.w2 = experts.w2
        self.kernel, self.alignment = kernel, alignment
        self.gemm = gemm if gemm is not None else torchao_grouped_gemm(kernel)

    def extra_repr(self) -> str:
        E, D, I = self.w2.shape
        return f"experts={E}, dim={D}, inter={I}, kernel={self.kernel}, alignment={self.alignment}"

    def forward(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Apply expert e to the rows of its group; rows are grouped by expert, group sizes counts_E."""
        device = x_AD.device.type
        y_AD = swiglu_grouped(x_AD, counts_E, self.w13, self.w2, self.gemm, self.alignment)
        # Hand back the dtype a high-precision matmul would give here: autocast's, else the input's.
        return y_AD.to(
            torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_AD.dtype
        )
