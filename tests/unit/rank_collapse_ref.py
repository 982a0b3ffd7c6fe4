"""The rank-collapse trio computed directly, for the diagnostics tests (unit and 2-rank): effective
rank, top singular value share and mean pairwise cosine from the float64 singular values of the
rows themselves (no Gram matrix, unlike components/observability/diagnostics.py)."""

import math

import torch


def direct_rank_collapse(x_RD: torch.Tensor) -> tuple[float, float, float]:
    x = x_RD.double()
    s = torch.linalg.svdvals(x)
    p = s / s.sum()
    p = p[p > 0]
    unit = x / x.norm(dim=1, keepdim=True)
    cos = unit @ unit.T
    r = x.shape[0]
    return (
        math.exp(-(p * p.log()).sum().item()),
        (s.max() / s.sum()).item(),
        ((cos.sum() - cos.diagonal().sum()) / (r * (r - 1))).item(),
    )
