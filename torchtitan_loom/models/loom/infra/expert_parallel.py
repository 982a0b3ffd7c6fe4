"""Expert parallelism: routed-expert weights sharded over the `ep` mesh, tokens sent to their owners.

`apply_expert_parallel(model, ep_mesh)` wraps every layer's `moe.experts`, whichever kind is
installed (plain RoutedExperts, float8 grouped experts, any moe.Experts), in an
`ExpertParallelExperts` with the same forward signature and meaning, so LoomMoE does not change.
The wrapper takes the weights over: w13 [E, 2I, D] and w2 [E, D, I] become its DTensors `Shard(0)`
over the 1-D ep mesh (ep rank j owns the contiguous experts [j*E/ep, (j+1)*E/ep), "block j"), and
the wrapped module, kept as its child `local` with no parameters of its own, is asked only for its
math (`Experts.compute` on this rank's shards, its row dtype and GEMM path). Parameter names stay
`layers.{l}.moe.experts.w13` / `.w2`, so checkpoints and the init rules match any layout.

Dispatch protocol of one MoE call (rows x_AD already grouped by expert ascending, counts_E):
  1. counts exchange: one all_to_all of counts_E (E/ep entries to each rank) gives
     recv_WL[s, e] = rows that source rank s holds for my local expert e.
  2. THE host sync (the only one): counts_E and recv_WL are copied to the host together with one
     `.tolist()` in `_split_sizes`; they give the send splits (rows per destination block), the
     receive splits (rows per source) and the local group sizes (the per-expert loop needs them).
  3. dispatch: all_to_all_single (autograd) sends block j of x_AD to rank j. The received rows are
     source-major (for each source, its rows per local expert); one gather regroups them
     local-expert-major (for each local expert, its rows from every source in rank order).
  4. the local experts run on the regrouped rows with the wrapped module's math (`compute`: the
     plain grouped GEMM or per-expert loop, or a float8 grouped GEMM).
  5. combine: the inverse gather restores source-major order, and a second all_to_all_single
     returns every row to its source in its original position, so out_AD lines up with x_AD.
Backward is the same two all_to_alls in reverse (autograd through the functional collectives).
Under torch.compile (fullgraph off with EP) step 2 is the one graph break of a capacity-off call; the rows are
cast to the wrapped experts' row dtype before step 3 (plain experts: bf16 under autocast or FSDP
mixed precision; float8 experts quantise the rows as they come, so they travel unchanged).
Weight gradients land on the local shards: the forward uses `to_local()` of the DTensor params.

Capacity keep/drop (LOOM_SPEC §14) is decided by LoomMoE on the LOCAL tokens, so expert
parallelism never changes which assignments survive, only where the expert math runs. With
capacity off every assignment is dispatched by the protocol above. With capacity C on, at most C
assignments per expert survive on each rank, so LoomMoE hands over only the kept ones in fixed
slots (`takes_capacity_slots`, moe.capacity_slots: E slots of C rows, padding weighted 0) and
the call makes NO host sync:
  1. kept counts exchange: an all_to_all of kept_E (device tensors, equal splits) gives recv_WL;
  2. dispatch: an all_to_all_single with equal splits of [L, C] rows per peer (no split sizes);
  3. the received [W, L, C] slots are put in (local expert, source, slot) order; math that skips rows past its groups (the plain grouped GEMM) gets the valid rows
     first (one stable sort on the device) with device offsets and skips the padding; any other
     (the per-expert loop, float8's padded groups) runs on every slot, W*C rows per expert;
  4. padding rows are zeroed (forward and backward), the inverse gather and a second equal-split
     all_to_all bring the slots home.
The padding travels (E·C rows per rank and call instead of the kept ones: at capacity factor f the
all-to-all moves f·N·K rows, today's capacity-off dispatch N·K) but the grouped GEMM computes only
kept rows (fewer FLOPs than dispatching dropped rows with weight 0 did); the others compute all E·C.

Backends: the same collectives (all_to_all_single with uneven, possibly empty splits) run on nccl
and on gloo, so there is one code path for both.

Legend: A assignment rows of this rank (N*K), D model dim, I expert width, E routed experts,
W ep ranks, L local experts (E/W), R rows received by this rank, C capacity, X slots (E*C).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan_loom.models.loom.moe import Experts

if TYPE_CHECKING:
    from torchtitan_loom.models.loom.model import LoomTransformer


class ExpertParallelExperts(Experts):
    """Any Experts with w13/w2 sharded `Shard(0)` over a 1-D ep mesh: the same Experts interface,
    its rows dispatched to the experts' owners, the wrapped module's math run on the local shards."""

    takes_capacity_slots = True  # LoomMoE may hand over the kept assignments in fixed slots

    def __init__(self, experts: Experts, ep_mesh: DeviceMesh):
        super().__init__()
        self.ep_mesh = ep_mesh
        # The weights move here, sharded; the wrapped module keeps its math (no parameters, so the
        # names and the state dict stay moe.experts.w13 / .w2). src_data_rank=None: each rank keeps
        # its own slice, no communication (the init is layout-independent; on meta there is no data).
        for name in ("w13", "w2"):
            full = getattr(experts, name)
            shard = distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            delattr(experts, name)
            self.register_parameter(name, nn.Parameter(shard, requires_grad=full.requires_grad))
        self.local = experts

    def extra_repr(self) -> str:
        E, W = self.w13.shape[0], self.ep_mesh.size()
        return f"experts={E}, local_experts={E // W}, ep={W}"

    # The math and its choices are the wrapped module's.
    def compute(
        self,
        x_AD: torch.Tensor,
        counts_E: torch.Tensor,
        w13_E2ID: torch.Tensor,
        w2_EDI: torch.Tensor,
        sizes_E: list[int] | None = None,
    ) -> torch.Tensor:
        return self.local.compute(x_AD, counts_E, w13_E2ID, w2_EDI, sizes_E)

    def compute_dtype(self, device_type: str, weight_dtype: torch.dtype) -> torch.dtype | None:
        return self.local.compute_dtype(device_type, weight_dtype)

    def skips_rows_past_groups(
        self, device_type: str, dtype: torch.dtype, compiling: bool, dim: int, inter: int
    ) -> bool:
        return self.local.skips_rows_past_groups(device_type, dtype, compiling, dim, inter)

    def fallback(
        self, device_type: str, dtype: torch.dtype, compiling: bool, dim: int, inter: int
    ) -> str | None:
        return self.local.fallback(device_type, dtype, compiling, dim, inter)

    def set_kernel_device(self, device_type: str | None) -> None:
        self.local.set_kernel_device(device_type)

    def _shards(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts' weights (autograd reaches the DTensors through to_local)."""
        return cast(DTensor, self.w13).to_local(), cast(DTensor, self.w2).to_local()

    def forward(
        self, x_AD: torch.Tensor, counts_E: torch.Tensor, capacity: int | None = None
    ) -> torch.Tensor:
        """Rows grouped by expert (group sizes counts_E, int64 [E]) -> expert outputs, same order.

        With `capacity` C: the rows are E slots of C (slot c of expert e valid when c < counts_E[e]);
        padding rows come back as zeros, and no host sync is made.
        """
        # Rows travel in the math's dtype (plain experts: bf16 under autocast or FSDP mixed
        # precision, half the all-to-all bytes of fp32, and the grouped GEMM takes them).
        x_AD = x_AD.to(self.input_dtype(x_AD))
        if capacity is not None:
            return self._forward_slots(x_AD, counts_E, capacity)
        group = self.ep_mesh.get_group()
        W = self.ep_mesh.size()
        E = counts_E.numel()
        L = E // W

        # 1. counts exchange: the E/W counts for block j go to rank j.
        recv_WL = funcol.all_to_all_single(counts_E.contiguous(), None, None, group).view(W, L)
        # 2. the one host sync of this call.
        send_splits, recv_splits, local_sizes_L = _split_sizes(counts_E, recv_WL)

        # 3. dispatch and regroup by local expert.
        recv_RD = funcol.all_to_all_single_autograd(
            x_AD.contiguous(), recv_splits, send_splits, group
        )
        order_R, back_R = _local_expert_order(recv_WL, sum(recv_splits))
        # 4. local experts on their rows.
        w13, w2 = self._shards()
        y_RD = self.local.compute(recv_RD[order_R], recv_WL.sum(0), w13, w2, local_sizes_L)
        # 5. back to source-major order, then home.
        return funcol.all_to_all_single_autograd(
            y_RD[back_R].contiguous(), send_splits, recv_splits, group
        )

    def _forward_slots(self, x_XD: torch.Tensor, kept_E: torch.Tensor, C: int) -> torch.Tensor:
        group, W = self.ep_mesh.get_group(), self.ep_mesh.size()
        E, D = kept_E.numel(), x_XD.shape[1]
        L = E // W
        # 1.-2. kept counts and the slots, equal splits (block j = experts of rank j).
        recv_WL = funcol.all_to_all_single(kept_E.contiguous(), None, None, group).view(W, L)
        recv_RD = funcol.all_to_all_single_autograd(x_XD.contiguous(), None, None, group)
        # 3. (local expert, source, slot) order of the received (source, local expert, slot) rows.
        device = x_XD.device
        order_R = torch.arange(W * L * C, device=device).view(W, L, C).transpose(0, 1).reshape(-1)
        valid_R = (torch.arange(C, device=device) < recv_WL.unsqueeze(-1)).transpose(0, 1)
        valid_R = valid_R.reshape(-1)
        w13, w2 = self._shards()
        compiling = torch.compiler.is_compiling()
        if self.local.skips_rows_past_groups(device.type, x_XD.dtype, compiling, D, w2.shape[2]):
            first_R = torch.argsort((~valid_R).to(torch.uint8), stable=True)  # valid rows first
            order_R, valid_R = order_R[first_R], valid_R[first_R]
            counts_L, sizes_L = recv_WL.sum(0), None
        else:  # every slot computed: group sizes W*C, known here
            counts_L, sizes_L = recv_WL.new_full((L,), W * C), [W * C] * L
        # Padding rows zeroed both ways (a grouped GEMM leaves rows past its groups unwritten).
        valid_R1 = valid_R.unsqueeze(-1)
        rows_RD = torch.where(valid_R1, recv_RD[order_R], 0)
        y_RD = torch.where(valid_R1, self.local.compute(rows_RD, counts_L, w13, w2, sizes_L), 0)
        # 4. home.
        return funcol.all_to_all_single_autograd(
            y_RD[_inverse(order_R)].contiguous(), None, None, group
        )


def _inverse(order_R: torch.Tensor) -> torch.Tensor:
    """The permutation p with order_R[p] = arange: gathering by it undoes a gather by order_R."""
    return torch.empty_like(order_R).scatter_(
        0, order_R, torch.arange(order_R.numel(), device=order_R.device)
    )


def all_to_alls_per_call(
    rows: int, dim: int, experts: int, row_bytes: int, recompute: bool
) -> list[tuple[str, int]]:
    """(what, bytes passed) of every all-to-all one MoE call makes on a rank: the counts exchange, the
    dispatch and the combine in forward (again when activation checkpointing recomputes the call), and
    the two row transfers of backward. `rows` = rows this rank dispatches; the rows it receives vary
    with the routing and match `rows` on average (summed over the ranks they are equal)."""
    forward = [
        ("counts", experts * 8),
        ("dispatch", rows * dim * row_bytes),
        ("combine", rows * dim * row_bytes),
    ]
    backward = [
        ("combine backward", rows * dim * row_bytes),
        ("dispatch backward", rows * dim * row_bytes),
    ]
    return forward * (2 if recompute else 1) + backward


def _split_sizes(
    counts_E: torch.Tensor, recv_WL: torch.Tensor
) -> tuple[list[int], list[int], list[int]]:
    """(send splits [W], receive splits [W], local group sizes [L]) from ONE device-to-host copy."""
    W, L = recv_WL.shape
    host = torch.cat([counts_E, recv_WL.reshape(-1)]).tolist()  # the host sync of the MoE call
    sent, received = host[: W * L], host[W * L :]
    send_splits = [sum(sent[j * L : (j + 1) * L]) for j in range(W)]
    recv_splits = [sum(received[s * L : (s + 1) * L]) for s in range(W)]
    local_sizes_L = [sum(received[s * L + e] for s in range(W)) for e in range(L)]
    return send_splits, recv_splits, local_sizes_L


def _local_expert_order(recv_WL: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices between the received (source-major) and the local-expert-major row orders.

    Returns (order_R, back_R): grouped = received[order_R] and received = grouped[back_R]. Built
    with tensor ops on the device; `num_rows` (known on the host) sizes the result without a sync.
    """
    W, L = recv_WL.shape
    sizes_S = recv_WL.reshape(-1)  # segments (source s, local expert e) in received order
    src_start_S = torch.cumsum(sizes_S, 0) - sizes_S
    # Segment (s, e) starts, in the grouped order (e outer, s inner), at this offset:
    sizes_by_expert = recv_WL.t().reshape(-1)
    dst_start_S = (torch.cumsum(sizes_by_expert, 0) - sizes_by_expert).view(L, W).t().reshape(-1)
    segment_R = torch.repeat_interleave(
        torch.arange(W * L, device=recv_WL.device), sizes_S, output_size=num_rows
    )
    rows_R = torch.arange(num_rows, device=recv_WL.device)
    back_R = dst_start_S[segment_R] + (
        rows_R - src_start_S[segment_R]
    )  # received row i -> grouped slot
    order_R = torch.empty_like(back_R).scatter_(0, back_R, rows_R)
    return order_R, back_R


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard every layer's routed experts over the 1-D `ep_mesh` (in place); returns the model.

    Works on a meta-device model (then `to_empty` + `init_weights` fill each rank's shard) and on
    a materialised one. Raises ValueError when the mesh is not 1-D or its size does not divide the
    routed-expert count.
    """
    if ep_mesh.ndim != 1:
        raise ValueError(
            f"apply_expert_parallel needs a 1-D ep mesh, got {ep_mesh.ndim} dims {ep_mesh.mesh_dim_names}"
        )
    ep = ep_mesh.size()
    for index, moe in enumerate(cast("LoomTransformer", model).moe_layers()):
        experts = moe.experts
        if isinstance(experts, ExpertParallelExperts):
            raise ValueError(f"expert parallelism is already applied to layer {index}")
        num_experts = experts.w13.shape[0]
        if num_experts % ep != 0:
            raise ValueError(
                f"parallelism.ep={ep} must divide num_routed_experts={num_experts}; "
                f"valid degrees: {[d for d in range(1, num_experts + 1) if num_experts % d == 0]}"
            )
        moe.experts = ExpertParallelExperts(experts, ep_mesh)
    return model


__all__ = ["ExpertParallelExperts", "apply_expert_parallel"]
