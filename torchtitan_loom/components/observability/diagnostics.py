"""Branch diagnostics of the training step: per layer and loop, what each observed branch output
looks like, from the step's own forward passes, read once at the end of the step.

Every ``metrics.diag_interval`` steps (keys ``diag/<branch>/<stat>/layer_<l>/loop_<t>``):

- ``norm``: mean over tokens of the token's L2 norm; ``var``: variance of all elements. Both over
  the real tokens of a micro-batch (padding left out), averaged over micro-batches and ranks.
- ``erank``, ``top_sv``, ``cos`` (the rank-collapse trio, ``metrics.diag_rank``): on 64 token rows of
  the first micro-batch of the logging rank, spread evenly over its real tokens (``sample_rows``):
  effective rank exp(entropy of σ / Σσ) of the 64 × D matrix (1 = collapsed, 64 = full), the top
  singular value's share σ_1 / Σσ, and the mean cosine between two different rows.
- ``diag/grad_norm/<submodule>/segment_<j>`` (``metrics.diag_grad``): L2 norm of each submodule's
  gradient in backprop segment j, before clipping; null for a segment that did not run.

Cost: the statistics are tensors on the device until the end of the step; then ONE all-reduce and
ONE device-to-host read bring them over (the 64 × 64 Gram matrices of the sample included, whose
eigenvalues are taken on the host in float64, so the device runs no eigen solver and waits for
nothing). The key set is built from the model's shape (layers, loops, branches, parameter
groups), never from what a rank saw, so every rank holds the same keys.

Legend: B rows, S sequence length, D model dim, L layers, H loops, T loops of a call, N observed
branches, K numbers per branch, R sample rows, G parameter groups, J segments.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchtitan_loom.distributed import utils as dist_utils

RANK_SAMPLE_ROWS = 64
MOMENTS = ("norm", "var")
RANK_STATS = ("erank", "top_sv", "cos")


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def sample_rows(valid_N: torch.Tensor, step: int, rows: int = RANK_SAMPLE_ROWS) -> torch.Tensor:
    """Indices of `rows` of the valid (non-padding) tokens of a flattened [N = B·S] micro-batch:
    evenly spaced over them in order, the offset moving with the step; some repeat when fewer
    than `rows` are valid. Computed on the device without reading the count."""
    order_N = torch.argsort((~valid_N).to(torch.int8), stable=True)  # valid tokens first, in order
    n_valid = valid_N.sum().clamp_min(1)
    stride = (n_valid // rows).clamp_min(1)
    pick_R = torch.arange(rows, device=valid_N.device) * n_valid // rows + step % stride
    return order_N[pick_R.clamp_max(n_valid - 1)]


def moments(x_BSD: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
    """fp32 [2] over the valid tokens: mean token L2 norm, element variance."""
    x_ND = x_BSD.detach().float().reshape(-1, x_BSD.shape[-1])
    w_N = valid_BS.reshape(-1).to(x_ND.dtype)
    count = w_N.sum().clamp_min(1)
    norm = (torch.linalg.vector_norm(x_ND, dim=-1) * w_N).sum() / count
    mean = (x_ND.sum(-1) * w_N).sum() / (count * x_ND.shape[-1])
    var = ((x_ND - mean).square().sum(-1) * w_N).sum() / (count * x_ND.shape[-1])
    return torch.stack([norm, var])


def rank_collapse(gram_RR: np.ndarray) -> tuple[float, float, float]:
    """(effective rank, top singular value share, mean pairwise cosine) of the rows X whose Gram
    matrix X Xᵀ is `gram_RR` (σ_i = sqrt of its eigenvalues), in float64 on the host."""
    g = np.asarray(gram_RR, dtype=np.float64)
    sigma = np.sqrt(np.clip(np.linalg.eigvalsh(g), 0.0, None))
    total = sigma.sum()
    if not total > 0:
        return float("nan"), float("nan"), float("nan")
    p = sigma[sigma > 0] / total
    inv = 1.0 / np.sqrt(np.clip(np.diagonal(g), 1e-30, None))
    cos = g * inv[:, None] * inv[None, :]
    r = g.shape[0]
    mean_cos = (cos.sum() - np.trace(cos)) / max(r * (r - 1), 1)
    return float(np.exp(-(p * np.log(p)).sum())), float(sigma.max() / total), float(mean_cos)


@dataclass(frozen=True)
class DiagOptions:
    interval: int
    activations: bool
    rank: bool
    grad: bool

    def due(self, step: int) -> bool:
        """Whether global step `step` (1-based) is a diagnostic step."""
        return (
            self.interval > 0
            and step % self.interval == 0
            and (self.activations or self.rank or self.grad)
        )


class StepDiagnostics:
    """One diagnostic step's accumulators (made by BranchDiagnostics.begin)."""

    def __init__(self, owner: BranchDiagnostics, step: int) -> None:
        self.owner, self.step = owner, step
        o = owner
        self.moments_LHNM = torch.zeros(
            o.L, o.H, o.N, len(MOMENTS), dtype=torch.float64, device=o.device
        )
        self.forwards_H = torch.zeros(o.H, dtype=torch.float64, device=o.device)
        self.grad_sq_JG = torch.zeros(o.J, len(o.groups), dtype=torch.float64, device=o.device)
        self.ran_J = torch.zeros(o.J, dtype=torch.float64, device=o.device)
        self.gram_LHNRR: torch.Tensor | None = None
        self.gram_loops: set[int] = set()

    def observer(
        self, micro_batch: int, valid_BS: torch.Tensor
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The `observe` function for a forward of micro-batch `micro_batch` whose real (non-padding)
        tokens are `valid_BS` (None: nothing to observe)."""
        o = self.owner
        if not (o.options.activations or o.options.rank) or o.N == 0:
            return None
        want_gram = o.options.rank and micro_batch == 0
        step = self.step

        rows_R = sample_rows(valid_BS.reshape(-1), step) if want_gram else None

        def observe(x_BSD: torch.Tensor) -> torch.Tensor:
            parts = [moments(x_BSD, valid_BS).double()]
            if rows_R is not None:
                # fp64: σ = sqrt(eigenvalue), so a Gram rounded at fp32 would show the zero σ of a
                # rank-deficient sample (R > D) as ~3e-4·σ_1 and inflate the effective rank.
                x_RD = x_BSD.detach().reshape(-1, x_BSD.shape[-1]).index_select(0, rows_R).double()
                parts.append((x_RD @ x_RD.T).reshape(-1))
            return torch.cat(parts)

        return observe

    def add_forward(self, loop_start: int, observed_LTNK: torch.Tensor | None) -> None:
        """Add one forward's observations (loops loop_start .. loop_start + T - 1)."""
        if observed_LTNK is None:
            return
        L, T, N, K = observed_LTNK.shape
        sl = slice(loop_start - 1, loop_start - 1 + T)
        m = len(MOMENTS)
        self.moments_LHNM[:, sl] += observed_LTNK[..., :m]
        self.forwards_H[sl] += 1
        if K > m:  # the first micro-batch also returned the sample's Gram matrices
            R = math.isqrt(K - m)
            if self.gram_LHNRR is None:
                self.gram_LHNRR = torch.zeros(
                    L, self.owner.H, N, R, R, dtype=torch.float64, device=self.owner.device
                )
            self.gram_LHNRR[:, sl] = observed_LTNK[..., m:].reshape(L, T, N, R, R)
            self.gram_loops.update(range(loop_start, loop_start + T))

    def add_gradients(self, segment: int, params: list[torch.nn.Parameter]) -> None:
        """Squared gradient norms per submodule of segment `segment` (0-based), after the gradient
        reduction and before the clip; nothing leaves the device."""
        o = self.owner
        if not o.options.grad or not o.groups:
            return
        have = [
            (o.group_of[i], p.grad)
            for i, p in enumerate(params)
            if p.grad is not None and o.group_of[i] >= 0
        ]
        if have:
            pieces_P = dist_utils.grad_norm_sq_pieces([g for _, g in have], _world())
            index_P = torch.tensor([g for g, _ in have], device=pieces_P.device)
            self.grad_sq_JG[segment].index_add_(0, index_P, pieces_P.to(self.grad_sq_JG.device))
        self.ran_J[segment] = 1.0

    def finish(self) -> dict[str, float | None]:
        """Every key of this step (null where a loop or segment did not run): one all-reduce, then
        one device-to-host read of everything."""
        o = self.owner
        summed = dist_utils.all_reduce(
            torch.cat(
                [
                    self.moments_LHNM.reshape(-1),
                    self.forwards_H,
                    self.grad_sq_JG.reshape(-1),
                    self.ran_J,
                ]
            )
        )
        parts = [summed] if self.gram_LHNRR is None else [summed, self.gram_LHNRR.reshape(-1)]
        flat = torch.cat(parts).cpu().numpy()  # the step's one extra transfer
        sizes = [self.moments_LHNM.numel(), o.H, self.grad_sq_JG.numel(), o.J]
        moments_LHNM, forwards_H, grad_sq_JG, ran_J, gram = np.split(flat, np.cumsum(sizes))
        moments_LHNM = moments_LHNM.reshape(self.moments_LHNM.shape)
        grad_sq_JG = grad_sq_JG.reshape(self.grad_sq_JG.shape)
        gram_LHNRR = None if self.gram_LHNRR is None else gram.reshape(self.gram_LHNRR.shape)
        out: dict[str, float | None] = {}
        for l in range(o.L):
            for t in range(o.H):
                for n, branch in enumerate(o.branches):
                    where = f"layer_{l}/loop_{t + 1}"
                    if o.options.activations:
                        for m, stat in enumerate(MOMENTS):
                            value = (
                                moments_LHNM[l, t, n, m] / forwards_H[t] if forwards_H[t] else None
                            )
                            out[f"diag/{branch}/{stat}/{where}"] = (
                                None if value is None else float(value)
                            )
                    if o.options.rank:
                        trio = (
                            rank_collapse(gram_LHNRR[l, t, n])
                            if gram_LHNRR is not None and t + 1 in self.gram_loops
                            else (None, None, None)
                        )
                        out.update(
                            {f"diag/{branch}/{s}/{where}": v for s, v in zip(RANK_STATS, trio)}
                        )
        if o.options.grad:
            for j in range(o.J):
                for g, group in enumerate(o.groups):
                    norm = math.sqrt(grad_sq_JG[j, g]) if ran_J[j] else None
                    out[f"diag/grad_norm/{group}/segment_{j + 1}"] = norm
        return out


class BranchDiagnostics:
    """The diagnostics of a run: which steps, which keys; ``begin(step)`` starts a step's accumulators."""

    def __init__(
        self,
        options: DiagOptions,
        *,
        branches: tuple[str, ...],
        num_layers: int,
        num_loops: int,
        num_segments: int,
        groups: dict[str, list[str]],
        param_names: list[str],
        device: torch.device,
    ) -> None:
        self.options, self.device = options, device
        self.branches, self.N = tuple(branches), len(branches)
        self.L, self.H, self.J = num_layers, num_loops, num_segments
        self.groups = list(groups)
        where = {name: g for g, names in enumerate(groups.values()) for name in names}
        self.group_of = [where.get(name, -1) for name in param_names]

    def begin(self, step: int) -> StepDiagnostics | None:
        """Accumulators for global step `step` (1-based) when it is a diagnostic step, else None."""
        return StepDiagnostics(self, step) if self.options.due(step) else None

    def keys(self) -> list[str]:
        """Every key a diagnostic step writes (the same on every rank, from the shapes alone)."""
        keys = []
        for l in range(self.L):
            for t in range(self.H):
                for branch in self.branches:
                    stats = (MOMENTS if self.options.activations else ()) + (
                        RANK_STATS if self.options.rank else ()
                    )
                    keys += [f"diag/{branch}/{s}/layer_{l}/loop_{t + 1}" for s in stats]
        if self.options.grad:
            keys += [
                f"diag/grad_norm/{g}/segment_{j + 1}" for j in range(self.J) for g in self.groups
            ]
        return keys


def build_diagnostics(
    metrics_cfg: Any,
    model: Any,
    num_segments: int,
    device: torch.device,
    num_loops: int | None = None,
) -> BranchDiagnostics:
    """The run's diagnostics from the ``[metrics]`` switches and the model's protocol surface
    (observed_branches, param_groups, num_loops); ``num_loops``: the loops a step may run when
    training.sample_depth_max reaches past the model's H."""
    options = DiagOptions(
        metrics_cfg.diag_interval,
        metrics_cfg.diag_activations,
        metrics_cfg.diag_rank,
        metrics_cfg.diag_grad,
    )
    on = options.interval > 0
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = model.param_groups() if on and options.grad else {}
    num_layers, branches = model.observed_branches() if on else (0, ())
    return BranchDiagnostics(
        options,
        branches=branches,
        num_layers=num_layers,
        num_loops=num_loops or model.num_loops,
        num_segments=num_segments,
        groups=groups,
        param_names=names,
        device=device,
    )
