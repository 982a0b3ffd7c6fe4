"""LOOM MoE layer (LOOM_SPEC.md §4.6): sigmoid router with selection-only bias, capacity keep/drop,
routed SwiGLU experts (grouped GEMM or a per-expert loop) and unweighted shared experts.

One call = one micro-batch, one layer, one loop. The router weight of the current loop arrives
as a tensor argument (the model picks `routers[t-1]`), so a compiled block serves every loop.
Counts of kept assignments are returned, never accumulated in buffers.

Legend: B batch rows, S sequence length, D model dim, N tokens (B*S), E routed experts,
K routed top-k, A assignments (N*K), I expert width, C capacity, X capacity slots (E*C).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from torchtitan_loom.models.loom.args import LoomModelArgs
from torchtitan_loom.models.loom.swiglu import gate_combine, swiglu_activation

GATE_SUM_FLOOR = 1e-9  # gate normalisation p = s / max(sum s, 1e-9), spec §4.6 step 5


def expert_capacity(
    num_tokens: int, top_k: int, num_experts: int, capacity_factor: float
) -> int | None:
    """C = max(1, floor(capacity_factor * N * k / E)); None when capacity_factor == 0 (no dropping)."""
    if capacity_factor == 0:
        return None
    return max(1, math.floor(capacity_factor * num_tokens * top_k / num_experts))


def route(
    x_ND: torch.Tensor, router_w_ED: torch.Tensor, expert_bias_E: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k selection by sigmoid score + bias; gate weights from the unbiased scores.

    Returns (fp32 logits [N, E], expert ids [N, K], normalised gate weights [N, K] in x's dtype).
    """
    # fp32 router even under autocast (which would otherwise run this matmul in bf16).
    with torch.autocast(device_type=x_ND.device.type, enabled=False):
        logits_NE = x_ND.float() @ router_w_ED.float().t()
    scores_NE = torch.sigmoid(logits_NE).to(x_ND.dtype)
    # The bias only decides which experts are chosen; the weights use the raw scores.
    _, expert_NK = (scores_NE + expert_bias_E.to(scores_NE.dtype)).topk(top_k, dim=-1)
    gate_NK = scores_NE.gather(1, expert_NK)
    gate_NK = gate_NK / gate_NK.sum(dim=-1, keepdim=True).clamp_min(GATE_SUM_FLOOR)
    return logits_NE, expert_NK, gate_NK


def capacity_plan(
    expert_NK: torch.Tensor, gate_NK: torch.Tensor, num_experts: int, capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Order assignments by expert and apply the keep rule of spec §4.6 item 7, with tensor ops only.

    Returns
      order_A   flat assignment indices (token*K + slot) grouped by expert ascending; within an
                expert, by gate weight descending, ties to the lower flat index;
      counts_E  int64 routed assignments per expert (before dropping; sizes the expert groups);
      kept_E    int64 kept assignments per expert (min(count, C));
      gate_NK   weights after dropping: dropped slots 0, each token that lost a slot renormalised
                over its survivors (0 if it lost all); tokens that lost nothing keep their weights.
    No host synchronisation: shapes depend only on N, K, E.
    """
    N, K = expert_NK.shape
    expert_A = expert_NK.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_A.device)
    counts_E.scatter_add_(0, expert_A, torch.ones_like(expert_A))
    if capacity is None:
        return torch.argsort(expert_A, stable=True), counts_E, counts_E, gate_NK
    # Two stable sorts = lexicographic (expert asc, weight desc, flat index asc).
    by_weight_A = torch.argsort(gate_NK.reshape(-1), descending=True, stable=True)
    order_A = by_weight_A[torch.argsort(expert_A[by_weight_A], stable=True)]
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    positions_A = torch.arange(N * K, device=expert_A.device)
    rank_in_expert_A = positions_A - starts_E[expert_A[order_A]]
    keep_A = torch.empty_like(expert_A, dtype=torch.bool)
    keep_A[order_A] = rank_in_expert_A < capacity
    keep_NK = keep_A.view(N, K)
    kept_gate_NK = gate_NK * keep_NK
    renormed_NK = kept_gate_NK / kept_gate_NK.sum(dim=-1, keepdim=True).clamp_min(GATE_SUM_FLOOR)
    lost_N1 = ~keep_NK.all(dim=-1, keepdim=True)
    gate_NK = torch.where(lost_N1, renormed_NK, gate_NK)
    return order_A, counts_E, counts_E.clamp_max(capacity), gate_NK


def capacity_slots(
    token_A: torch.Tensor, gate_A: torch.Tensor, counts_E: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept assignments laid out in E slots of `capacity` rows each (X = E*C), tensor ops only.

    Takes the assignments in capacity_plan's order (grouped by expert, kept ones first in each
    group) with their tokens and gate weights. Returns (token_X, gate_X): slot e*C + r holds the
    r-th kept assignment of expert e; an unfilled slot points at token 0 with weight 0.
    """
    E, A = counts_E.numel(), token_A.numel()
    device = token_A.device
    expert_A = torch.repeat_interleave(torch.arange(E, device=device), counts_E, output_size=A)
    rank_A = torch.arange(A, device=device) - (torch.cumsum(counts_E, 0) - counts_E)[expert_A]
    # Dropped assignments all go to one extra slot, cut off below.
    slot_A = torch.where(rank_A < capacity, expert_A * capacity + rank_A, E * capacity)
    token_X = token_A.new_zeros(E * capacity + 1).scatter(0, slot_A, token_A)[:-1]
    gate_X = gate_A.new_zeros(E * capacity + 1).scatter(0, slot_A, gate_A)[:-1]
    return token_X, gate_X


def swiglu(x_MD: torch.Tensor, w13_2ID: torch.Tensor, w2_DI: torch.Tensor) -> torch.Tensor:
    """W_d (silu(W_g x) * W_u x) with W_g, W_u the first and second halves of w13."""
    return swiglu_activation(x_MD @ w13_2ID.t()) @ w2_DI.t()


def gemm_path(
    device_type: str,
    dtype: torch.dtype,
    compiling: bool,
    dim: int,
    inter: int,
    impl: str = "grouped",
) -> tuple[str, str]:
    """("grouped" | "loop", why): how the routed experts run, from these inputs only.

    torch._grouped_mm needs 16-byte aligned strides and bf16, except in CPU eager mode (its CUDA
    kernels and its compile-time shape check take bf16 only). The loop slices the rows on the
    host: one `.tolist()` sync per call (a data-dependent graph under compile).
    """
    if impl == "loop":
        return "loop", "moe_impl='loop'"
    if not hasattr(torch, "_grouped_mm"):
        return "loop", f"torch {torch.__version__} has no torch._grouped_mm"
    if dtype != torch.bfloat16 and (device_type != "cpu" or compiling):
        where = "compiled" if compiling else f"on {device_type}"
        return "loop", f"grouped GEMM {where} needs bfloat16, the experts compute in {dtype}"
    align = 16 // torch.empty((), dtype=dtype).element_size()
    if dim % align or inter % align:
        return (
            "loop",
            f"dim={dim} and expert width={inter} must be multiples of {align} for {dtype} grouped GEMM",
        )
    return "grouped", "grouped GEMM"


def expert_dtype(device_type: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the experts compute in: autocast's when it is on (single process, bf16), else the
    weights' (FSDP's MixedPrecisionPolicy has already cast them to param_dtype)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight_dtype


class Experts(nn.Module):
    """The routed-experts interface LoomMoE calls, one per implementation: the plain experts below
    and a low-precision grouped GEMM (models/loom/float8_experts.py); expert parallelism
    (infra/expert_parallel.py) wraps either. Every one holds E SwiGLU experts packed under the same
    names and shapes, w13 [E, 2I, D] (gate rows then up rows) and w2 [E, D, I], so checkpoints, the
    init rules and the parameter counts do not depend on which one runs.

    An implementation's math is `compute` on weights it is given, so a wrapper that holds the
    weights elsewhere (expert parallelism: this rank's shards) runs the same math around it."""

    # Every implementation registers these two parameters (declared here for their type).
    w13: nn.Parameter
    w2: nn.Parameter

    takes_capacity_slots = False
    """True: with capacity on, forward takes only the kept assignments, in E fixed slots of C rows
    (moe.capacity_slots) and ``capacity=C``; False: every assignment, grouped by expert."""

    def compute(
        self,
        x_AD: torch.Tensor,
        counts_E: torch.Tensor,
        w13_E2ID: torch.Tensor,
        w2_EDI: torch.Tensor,
        sizes_E: list[int] | None = None,
    ) -> torch.Tensor:
        """The experts' math: expert e (weights w13_E2ID[e], w2_EDI[e]) on the rows of group e
        (rows grouped by expert, group sizes counts_E; `sizes_E` the same as Python ints when the
        caller has them on the host)."""
        raise NotImplementedError

    def compute_dtype(self, device_type: str, weight_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype `compute` wants its rows in for weights of `weight_dtype`; None: the rows' own."""
        return None

    def skips_rows_past_groups(
        self, device_type: str, dtype: torch.dtype, compiling: bool, dim: int, inter: int
    ) -> bool:
        """True when `compute` takes rows past the last group (sum(counts_E) < rows), leaving their
        outputs unwritten; False: the groups must cover every row."""
        return False

    def fallback(
        self, device_type: str, dtype: torch.dtype, compiling: bool, dim: int, inter: int
    ) -> str | None:
        """Why `compute` runs the per-expert loop for these inputs, or None."""
        return None

    def input_dtype(self, x_ND: torch.Tensor) -> torch.dtype:
        """The dtype LoomMoE casts the rows to before gathering them (one [A, D] copy, not two)."""
        return self.compute_dtype(x_ND.device.type, self.w13.dtype) or x_ND.dtype

    def set_kernel_device(self, device_type: str | None) -> None:
        """Choose the GEMM path for ``device_type`` instead of the rows' device (None: the rows');
        an implementation with a single kernel ignores it."""

    def gemm_fallback(self, device_type: str, dtype: torch.dtype, compiling: bool) -> str | None:
        """Why these experts will run the per-expert loop on this device and dtype, or None."""
        _, dim, inter = self.w2.shape
        return self.fallback(device_type, dtype, compiling, dim, inter)

    def forward(
        self, x_AD: torch.Tensor, counts_E: torch.Tensor, capacity: int | None = None
    ) -> torch.Tensor:
        """Rows grouped by expert (group sizes counts_E, int64 [E]) -> expert outputs, same order."""
        return self.compute(x_AD, counts_E, self.w13, self.w2)


class RoutedExperts(Experts):
    """The plain experts: grouped GEMM or the per-expert loop (moe_impl), on any device."""

    def __init__(self, num_experts: int, dim: int, inter: int, impl: str):
        super().__init__()
        self.impl = impl
        self.kernel_device: str | None = None  # the GEMM path's device; None: the rows'
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, inter))

    def compute(
        self,
        x_AD: torch.Tensor,
        counts_E: torch.Tensor,
        w13_E2ID: torch.Tensor,
        w2_EDI: torch.Tensor,
        sizes_E: list[int] | None = None,
    ) -> torch.Tensor:
        return run_experts(
            x_AD, counts_E, w13_E2ID, w2_EDI, self.impl, sizes_E, device_type=self.kernel_device
        )

    def compute_dtype(self, device_type: str, weight_dtype: torch.dtype) -> torch.dtype:
        return expert_dtype(device_type, weight_dtype)

    def skips_rows_past_groups(
        self, device_type: str, dtype: torch.dtype, compiling: bool, dim: int, inter: int
    ) -> bool:
        # The grouped GEMM stops at the last offset; the loop splits every row into a group.
        kernel = self.kernel_device or device_type
        return gemm_path(kernel, dtype, compiling, dim, inter, self.impl)[0] == "grouped"

    def fallback(
        self, device_type: str, dtype: torch.dtype, compiling: bool, dim: int, inter: int
    ) -> str | None:
        path, why = gemm_path(device_type, dtype, compiling, dim, inter, self.impl)
        return why if path == "loop" else None

    def set_kernel_device(self, device_type: str | None) -> None:
        self.kernel_device = device_type


def run_experts(
    x_AD: torch.Tensor,
    counts_E: torch.Tensor,
    w13_E2ID: torch.Tensor,
    w2_EDI: torch.Tensor,
    impl: str,
    sizes_E: list[int] | None = None,
    device_type: str | None = None,
) -> torch.Tensor:
    """SwiGLU expert e on the rows of group e (rows grouped by expert, group sizes counts_E).

    `sizes_E` = counts_E as Python ints when the caller already has them on the host (expert
    parallel does), so the per-expert loop does not synchronise a second time. `device_type`: the
    device the GEMM path is chosen for (None: the rows'; see models/loom/target.py).
    """
    D, I = w2_EDI.shape[1], w2_EDI.shape[2]
    # Autocast does not cover _grouped_mm: cast the rows and the weights here (a no-op under FSDP
    # bf16, where both already are), so the routed experts compute in bf16 like the shared ones.
    dtype = expert_dtype(x_AD.device.type, w13_E2ID.dtype)
    x_AD, w13_E2ID, w2_EDI = x_AD.to(dtype), w13_E2ID.to(dtype), w2_EDI.to(dtype)
    path, _ = gemm_path(
        device_type or x_AD.device.type, dtype, torch.compiler.is_compiling(), D, I, impl
    )
    if path == "grouped":
        offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)  # group ends, stays on device
        h_A2I = torch._grouped_mm(x_AD, w13_E2ID.transpose(-2, -1), offs=offsets_E)
        act_AI = swiglu_activation(h_A2I)
        return torch._grouped_mm(act_AI, w2_EDI.transpose(-2, -1), offs=offsets_E)
    # Per-expert loop (moe_impl='loop', or shapes/dtypes grouped GEMM cannot take; the trainer logs
    # which layer and why once, see moe_gemm_fallbacks). Host sync: Python slices by group size.
    chunks = x_AD.split(counts_E.tolist() if sizes_E is None else sizes_E)
    return torch.cat([swiglu(chunk, w13_E2ID[e], w2_EDI[e]) for e, chunk in enumerate(chunks)])


def moe_gemm_fallbacks(
    moe_layers, device_type: str, dtype: torch.dtype, compiling: bool
) -> list[str]:
    """One line per layer whose routed experts will use the per-expert loop, and why (for the run log).

    `dtype` is the compute dtype of the run (autocast's or FSDP's param_dtype): the one the
    experts see, since run_experts casts to it.
    """
    lines = []
    for index, moe in enumerate(moe_layers):
        why = moe.experts.gemm_fallback(device_type, dtype, compiling)
        if why is not None:
            lines.append(f"layer {index}: routed experts use the per-expert loop ({why})")
    return lines


class SharedExpert(nn.Module):
    """One always-on SwiGLU expert: w13 [2I, D], w2 [D, I]."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        # swiglu() through the Linear modules (same math as swiglu(x, w13.weight, w2.weight)), so
        # a module swap such as float8's Float8Linear takes effect.
        return self.w2(swiglu_activation(self.w13(x_ND)))


class LoomMoE(nn.Module):
    """Per-loop routers (separate parameters), `expert_bias` buffer, routed and shared experts."""

    expert_bias: torch.Tensor  # registered as a buffer in __init__ (declared here for its type)

    def __init__(self, args: LoomModelArgs):
        super().__init__()
        E, D, I = args.num_routed_experts, args.dim, args.expert_intermediate_size
        self.num_experts, self.top_k = E, args.routed_top_k
        self.capacity_factor = args.capacity_factor
        self.z_loss_enabled = args.router_z_loss_coef > 0
        # routers.{t} serves loop t+1 (only routers.0 when router_per_loop=False).
        self.routers = nn.ParameterList(
            [nn.Parameter(torch.empty(E, D)) for _ in range(args.num_routers)]
        )
        self.register_buffer("expert_bias", torch.zeros(E), persistent=True)
        self.experts: Experts = RoutedExperts(E, D, I, args.moe_impl)
        self.shared_experts = nn.ModuleList(
            [SharedExpert(D, I) for _ in range(args.num_shared_experts)]
        )

    def select(self, x_BSD: torch.Tensor, router_w_ED: torch.Tensor) -> torch.Tensor:
        """The top-k expert ids [B, S, K] that forward() routes x to (before capacity dropping).

        Only for analysis: it repeats forward's router matmul, so training never pays for it.
        """
        B, S, D = x_BSD.shape
        _, expert_NK, _ = route(x_BSD.reshape(B * S, D), router_w_ED, self.expert_bias, self.top_k)
        return expert_NK.view(B, S, self.top_k)

    def forward(
        self, x_BSD: torch.Tensor, router_w_ED: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (output [B, S, D], kept assignments per expert int64 [E], z-loss term).

        The z-loss term is mean_n logsumexp(logits_n)^2 (fp32), or a 0 tensor when the
        coefficient is 0 (then it is not computed).
        """
        B, S, D = x_BSD.shape
        N, K = B * S, self.top_k
        x_ND = x_BSD.reshape(N, D)
        logits_NE, expert_NK, gate_NK = route(x_ND, router_w_ED, self.expert_bias, K)
        capacity = expert_capacity(N, K, self.num_experts, self.capacity_factor)
        order_A, counts_E, kept_E, gate_NK = capacity_plan(
            expert_NK, gate_NK, self.num_experts, capacity
        )

        x_cast_ND = x_ND.to(self.experts.input_dtype(x_ND))  # before the gather: one copy
        gate_A = gate_NK.reshape(-1)[order_A]
        token_A = order_A // K
        if capacity is not None and self.experts.takes_capacity_slots:
            # Only the kept assignments, in E fixed slots of C rows (padding weighted 0): shapes
            # known on the host, so expert parallelism needs no split sizes from the device.
            token_A, gate_A = capacity_slots(token_A, gate_A, counts_E, capacity)  # [X]: X = E*C
            out_AD = self.experts(x_cast_ND[token_A], kept_E, capacity=capacity)
        else:
            # Every assignment (dropped ones too, weighted 0: fixed shapes, no sync).
            out_AD = self.experts(x_cast_ND[token_A], counts_E)
        # Combine: each output weighted by its gate and added into its token's row (no [N, K, D]
        # buffer). The K terms of a token add up in expert order, not slot order: fp32 rounding.
        y_ND = gate_combine(out_AD, gate_A, token_A, N)
        for shared in self.shared_experts:
            y_ND = y_ND + shared(x_ND)

        if self.z_loss_enabled:
            z_sq = torch.logsumexp(logits_NE, dim=-1).pow(2).mean()
        else:
            z_sq = logits_NE.new_zeros(())
        return y_ND.view(B, S, D), kept_E, z_sq
