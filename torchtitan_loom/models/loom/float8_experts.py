"""LOOM's routed experts on a low-precision grouped GEMM (TrainSpec.float8_experts_fn).

The float8 converter (components/quantization/float8.py) decides which kernel a device runs and
hands it over as a protocols.GroupedKernel; this file is the only one that knows what LOOM computes
with it: the SwiGLU of the packed w13 [E, 2I, D] (gate rows then up rows) and w2 [E, D, I].
`Float8GroupedExperts` keeps the Experts contract of moe.py (rows grouped by expert, counts_E ->
out rows) and the same Parameter objects (names, shapes, init rules), so checkpoints load either
way; only the GEMMs change. The rows are padded per group to the kernel's alignment first (the
kernel's layout), and read back from the same positions.

Legend: A assignment rows (grouped by expert), P padded rows, D model dim, I expert width,
E routed experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from torchtitan_loom.models.loom.moe import Experts, RoutedExperts
from torchtitan_loom.models.loom.swiglu import swiglu_activation
from torchtitan_loom.protocols import GroupedKernel

if TYPE_CHECKING:
    from torchtitan_loom.models.loom.block import LoomBlock


def swiglu_grouped(
    x_AD: torch.Tensor,
    counts_E: torch.Tensor,
    w13_E2ID: torch.Tensor,
    w2_EDI: torch.Tensor,
    kernel: GroupedKernel,
) -> torch.Tensor:
    """W_d (silu(W_g x) * W_u x) per expert group, through `kernel` on alignment-padded groups."""
    A, D = x_AD.shape
    dest_A, ends_E, P = kernel.pad_rows(counts_E, A)
    x_PD = x_AD.new_zeros(P, D).index_copy(0, dest_A, x_AD)
    # Weights stay [E, out, in]; the kernels take the transposed (column-major) view.
    h_P2I = kernel.gemm(x_PD, w13_E2ID.transpose(-2, -1), ends_E)
    y_PD = kernel.gemm(swiglu_activation(h_P2I), w2_EDI.transpose(-2, -1), ends_E)
    return y_PD.index_select(0, dest_A)


class Float8GroupedExperts(Experts):
    """RoutedExperts' parameters (w13 [E, 2I, D], w2 [E, D, I]) with a low-precision grouped GEMM.
    The rows are quantised as they come (input_dtype: the rows' own), on the kernel's one path."""

    def __init__(self, experts: RoutedExperts, kernel: GroupedKernel):
        super().__init__()
        self.w13 = experts.w13  # the same Parameter objects: names, shapes and init rules unchanged
        self.w2 = experts.w2
        self.kernel = kernel

    def extra_repr(self) -> str:
        return f"kernel={self.kernel.name}, alignment={self.kernel.alignment}"

    def compute(
        self,
        x_AD: torch.Tensor,
        counts_E: torch.Tensor,
        w13_E2ID: torch.Tensor,
        w2_EDI: torch.Tensor,
        sizes_E: list[int] | None = None,
    ) -> torch.Tensor:
        """Apply expert e to the rows of its group; rows are grouped by expert, group sizes counts_E."""
        device = x_AD.device.type
        y_AD = swiglu_grouped(x_AD, counts_E, w13_E2ID, w2_EDI, self.kernel)
        # Hand back the dtype a high-precision matmul would give here: autocast's, else the input's.
        return y_AD.to(
            torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_AD.dtype
        )


def convert_float8_experts(
    model: nn.Module, kernel: GroupedKernel, filter_fqns: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, str]]:
    """TrainSpec.float8_experts_fn: every layer's plain routed experts become Float8GroupedExperts
    unless a name in `filter_fqns` matches or the dims are not multiples of the kernel's; returns
    (names converted, {name skipped: why})."""
    chosen, skipped = [], {}
    # model is a LoomTransformer (iterating an nn.ModuleList yields nn.Module)
    for index, layer in enumerate(cast("Iterable[LoomBlock]", model.layers)):
        fqn, experts = f"layers.{index}.moe.experts", layer.moe.experts
        if type(experts) is not RoutedExperts:
            continue
        _, dim, inter = experts.w2.shape
        multiple = kernel.dim_multiple
        if any(f in fqn for f in filter_fqns):
            skipped[fqn] = "matches float8.filter_fqns"
        elif dim % multiple or inter % multiple:
            skipped[fqn] = (
                f"dim {dim} / expert width {inter} not multiples of {multiple} ({kernel.name})"
            )
        else:
            layer.moe.experts = Float8GroupedExperts(experts, kernel)
            chosen.append(fqn)
    return chosen, skipped
