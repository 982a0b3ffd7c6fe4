"""Routing diversity across loops and stream statistics, accumulated over eval batches.

Feed one micro-batch at a time: ``start_batch(valid_BS)``, then ``add_loop(topk_LBSK, z_BSD, rms_BS)`` for
loops 1..H in order (the eval already runs the loops one at a time with the carry). Only valid
tokens count (doc id >= 0; padding is excluded). ``all_reduce`` sums the totals over ranks;
``summary`` turns them into the scalars below, each routing one computed per layer and then
averaged over the L layers (README "Routing diversity" has the same definitions):

    routing_distinct_experts       mean over tokens of |A_1 ∪ ... ∪ A_H|, A_t = the token's top-k set at loop t
    routing_overlap_loop_t         mean over tokens of |A_t ∩ A_t+1| / k            (t = 1..H-1)
    routing_overlap                mean of routing_overlap_loop_t over t
    routing_load_entropy_loop_t    -Σ_e p_e log p_e / log E, p = loop t's load share over experts
    routing_load_max_mean_loop_t   max_e load / mean_e load of loop t (1 = perfectly balanced)
    routing_load_entropy, routing_load_max_mean   their means over loops
    routing_dead_experts           experts chosen by no token in any loop
    routing_dead_experts_per_loop  experts chosen by no token in a loop, mean over loops
    stream_rms_loop_t              sqrt(mean over tokens of rms²), rms = the model's per-token stream RMS
                                   in loop t where it can move (LOOM: before the loop's closing norm)
    stream_cos_loop_t              mean over tokens of cos(z after loop t, z after loop t+1)

Load = number of times an expert is in a token's top-k (the router's choice, before capacity).

Legend: L layers, H loops, B rows, S sequence length, N valid tokens, K top-k, E experts, D dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


class RoutingStats:
    """Sums over valid tokens for the diversity metrics; float64 / int64 so ranks can sum them."""

    def __init__(
        self,
        num_layers: int,
        num_loops: int,
        num_experts: int,
        top_k: int,
        device: torch.device | str = "cpu",
    ) -> None:
        L, H, E = num_layers, num_loops, num_experts
        self.L, self.H, self.E, self.K = L, H, E, top_k

        def f64(*size: int) -> torch.Tensor:
            return torch.zeros(*size, dtype=torch.float64, device=device)

        self.load_LHE = torch.zeros(L, H, E, dtype=torch.int64, device=device)
        self.distinct_sum_L = f64(L)
        self.overlap_sum_LP = f64(L, max(H - 1, 0))  # P: consecutive loop pairs
        self.sq_sum_H = f64(H)
        self.cos_sum_P = f64(max(H - 1, 0))
        self.tokens = f64(1)
        self._batch: _BatchState | None = None

    # ----------------------------------------------------------------- feeding
    def start_batch(self, valid_BS: torch.Tensor) -> None:
        """Begin a micro-batch; valid_BS is True on real tokens (doc id >= 0)."""
        if self._batch is not None and self._batch.loop < self.H:
            raise RuntimeError(
                f"RoutingStats: previous batch got {self._batch.loop} of {self.H} loops"
            )
        valid_N = valid_BS.reshape(-1).to(self.load_LHE.device).bool()
        self._batch = _BatchState(valid_N)
        self.tokens += valid_N.sum()

    def add_loop(self, topk_LBSK: torch.Tensor, z_BSD: torch.Tensor, rms_BS: torch.Tensor) -> None:
        """The next loop's chosen expert ids [L, B, S, K], the stream after it [B, S, D] (its
        direction: the cosine) and its per-token RMS [B, S] (``ModelProtocol.stream_rms``)."""
        b = self._batch
        if b is None or b.loop >= self.H:
            raise RuntimeError(
                "RoutingStats.add_loop: call start_batch first, then exactly H loops"
            )
        L, K = self.L, self.K
        ids_LNK = topk_LBSK.reshape(L, -1, K)[:, b.valid_N].to(self.load_LHE.device)
        onehot_LNE = torch.zeros(
            L, ids_LNK.shape[1], self.E, dtype=torch.bool, device=ids_LNK.device
        )
        onehot_LNE.scatter_(2, ids_LNK, True)
        z_ND = z_BSD.reshape(-1, z_BSD.shape[-1])[b.valid_N].to(self.load_LHE.device).double()
        t = b.loop  # 0-based index of this loop
        self.load_LHE[:, t] += onehot_LNE.sum(1)
        rms_N = rms_BS.reshape(-1)[b.valid_N].to(self.load_LHE.device).double()
        self.sq_sum_H[t] += rms_N.pow(2).sum()
        if t == 0:
            b.union_LNE = onehot_LNE.clone()
        else:
            # loop 0 (an earlier call) set them
            assert b.union_LNE is not None and b.prev_LNE is not None and b.prev_z_ND is not None
            b.union_LNE |= onehot_LNE
            self.overlap_sum_LP[:, t - 1] += (onehot_LNE & b.prev_LNE).sum((1, 2)).double() / K
            self.cos_sum_P[t - 1] += torch.nn.functional.cosine_similarity(
                z_ND, b.prev_z_ND, dim=-1
            ).sum()
        b.prev_LNE, b.prev_z_ND, b.loop = onehot_LNE, z_ND, t + 1
        if b.loop == self.H:
            self.distinct_sum_L += b.union_LNE.sum((1, 2)).double()

    def all_reduce(self, reduce_fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum every total over ranks with reduce_fn (e.g. distributed.utils.all_reduce)."""
        for tensor in (
            self.load_LHE,
            self.distinct_sum_L,
            self.overlap_sum_LP,
            self.sq_sum_H,
            self.cos_sum_P,
            self.tokens,
        ):
            reduce_fn(tensor)

    # ----------------------------------------------------------------- results
    def per_layer(self) -> list[dict[str, float]]:
        """One dict per layer: distinct_experts, overlap, load_entropy, load_max_mean (means over
        loops), dead_experts, dead_experts_per_loop. Empty list before any valid token."""
        n = float(self.tokens.item())
        if n == 0:
            return []
        load_LHE = self.load_LHE.double()
        entropy_LH = load_entropy(load_LHE)
        max_mean_LH = load_LHE.amax(-1) / load_LHE.mean(-1)
        rows = []
        for layer in range(self.L):
            overlap = self.overlap_sum_LP[layer] / n
            rows.append(
                {
                    "distinct_experts": float(self.distinct_sum_L[layer]) / n,
                    "overlap": float(overlap.mean()) if overlap.numel() else float("nan"),
                    "load_entropy": float(entropy_LH[layer].mean()),
                    "load_max_mean": float(max_mean_LH[layer].mean()),
                    "dead_experts": int((self.load_LHE[layer].sum(0) == 0).sum()),
                    "dead_experts_per_loop": float(
                        (self.load_LHE[layer] == 0).sum(-1).double().mean()
                    ),
                }
            )
        return rows

    def summary(self) -> dict[str, float]:
        """The scalars of the module docstring (routing ones averaged over layers); {} before any
        valid token."""
        n = float(self.tokens.item())
        rows = self.per_layer()
        if not rows:
            return {}
        out = {f"routing_{key}": sum(r[key] for r in rows) / len(rows) for key in rows[0]}
        load_LHE = self.load_LHE.double()
        entropy_H = load_entropy(load_LHE).mean(0)
        max_mean_H = (load_LHE.amax(-1) / load_LHE.mean(-1)).mean(0)
        overlap_P = self.overlap_sum_LP.mean(0) / n
        for t in range(self.H):
            out[f"routing_load_entropy_loop_{t + 1}"] = float(entropy_H[t])
            out[f"routing_load_max_mean_loop_{t + 1}"] = float(max_mean_H[t])
            out[f"stream_rms_loop_{t + 1}"] = math.sqrt(float(self.sq_sum_H[t]) / n)
        for t in range(self.H - 1):
            out[f"routing_overlap_loop_{t + 1}"] = float(overlap_P[t])
            out[f"stream_cos_loop_{t + 1}"] = float(self.cos_sum_P[t]) / n
        return out

    def load_share_LHE(self) -> torch.Tensor:
        """Load ÷ uniform load per (layer, loop): 1 = the expert got exactly 1/E of the choices."""
        load_LHE = self.load_LHE.double()
        return load_LHE / load_LHE.mean(-1, keepdim=True).clamp_min(1e-12)


def load_entropy(load_XE: torch.Tensor) -> torch.Tensor:
    """Entropy of each row's load share, normalised by log E to [0, 1] (0·log 0 = 0)."""
    p_XE = load_XE / load_XE.sum(-1, keepdim=True).clamp_min(1e-12)
    plogp_XE = torch.where(p_XE > 0, p_XE * p_XE.clamp_min(1e-300).log(), torch.zeros_like(p_XE))
    return -plogp_XE.sum(-1) / math.log(load_XE.shape[-1])


class _BatchState:
    """Per-micro-batch scratch: valid mask, union of choices so far, the previous loop's choices and stream."""

    def __init__(self, valid_N: torch.Tensor) -> None:
        self.valid_N = valid_N
        self.loop = 0
        self.union_LNE: torch.Tensor | None = None
        self.prev_LNE: torch.Tensor | None = None
        self.prev_z_ND: torch.Tensor | None = None
