"""Deliberately simple, unfused reference of the LOOM forward, written from LOOM_SPEC.md §4 / §14.

It exists only to check the real model: plain Python loops over rows, documents, heads, tokens and
experts, everything in float64, no fused kernels, no SDPA, no grouped GEMM. Slow by design; use it
on tiny shapes only.

Shape legend: B batch rows, S sequence length, D model dim, V vocab, E routed experts, I expert
width, nh / nkv query / key-value heads, hd head dim, N tokens of the call (B·S), K routed top-k.
"""

import math

import torch
from torch import Tensor

LOOP_STATE_FLOOR = 1e-6  # max(D, 1e-6) in the Looping-Residual readout (§4.4 steps 8-9)
GATE_SUM_FLOOR = 1e-9  # clamp on the sum of selected sigmoid scores (§4.6 step 5)


def gamma(H: int, L: int, lam: float) -> float:
    """Residual gain γ = ε = λ / (H·√L), the same for every loop (§4.3 step 2)."""
    return lam / (H * math.sqrt(L))


def inject_g(t: int, L: int, lam: float) -> float:
    """Embedding re-injection weight g_t = clamp(λ / (t·√L), 0, 1) for loop t ≥ 2 (§4.3 step 1)."""
    return min(max(lam / (t * math.sqrt(L)), 0.0), 1.0)


def rms(v: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """RMS(v) = v / sqrt(mean(v²) + eps) over the last dim, optionally times a weight (RMS_w)."""
    out = v / torch.sqrt((v * v).mean(dim=-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def ema_write(
    num: Tensor | None, den: Tensor | None, u: Tensor, beta: float
) -> tuple[Tensor, Tensor]:
    """One Looping-Residual memory write (§4.4 steps 8-9).

    If the memory is empty: N = u, D = 1; else N ← β·N + u, D ← β·D + 1.
    """
    if num is None:
        return u, torch.ones_like(u[..., :1])
    return beta * num + u, beta * den + 1


def ema_read(num: Tensor, den: Tensor) -> Tensor:
    """Memory readout N / max(D, 1e-6)."""
    return num / den.clamp(min=LOOP_STATE_FLOOR)


def rope(x_SHd: Tensor, pos_S: Tensor, theta: float) -> Tensor:
    """Rotate-half RoPE over the full head dim; angle = position · θ^(−2i/hd), frequencies doubled."""
    hd = x_SHd.shape[-1]
    half = hd // 2
    i = torch.arange(half, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * i / hd)
    ang = pos_S.to(torch.float64)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)  # [S, hd]
    cos = ang.cos()[:, None, :].to(x_SHd.dtype)
    sin = ang.sin()[:, None, :].to(x_SHd.dtype)
    x1, x2 = x_SHd[..., :half], x_SHd[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_SHd * cos + rotated * sin


def attention_branch(
    sd: dict, cfg: dict, l: int, h_BSD: Tensor, pos_BS: Tensor, doc_BS: Tensor
) -> Tensor:
    """Gated GQA attention a = (σ(G) ⊙ Attn(Q, K, V)) · W_o^T, per row and per document (§4.4 1-6)."""
    B, S, D = h_BSD.shape
    nh, nkv = cfg["n_heads"], cfg["n_kv_heads"]
    hd = D // nh
    group = nh // nkv  # query head h reads kv head h // group (repeat-interleave of kv heads)
    w_qkv = sd[f"layers.{l}.attention.wqkv.weight"]
    w_o = sd[f"layers.{l}.attention.wo.weight"]
    out_BSD = torch.zeros_like(h_BSD)
    for b in range(B):
        P = h_BSD[b] @ w_qkv.T
        G = P[:, : nh * hd].reshape(S, nh, hd)
        Q = P[:, nh * hd : 2 * nh * hd].reshape(S, nh, hd)
        K = P[:, 2 * nh * hd : 2 * nh * hd + nkv * hd].reshape(S, nkv, hd)
        Vv = P[:, 2 * nh * hd + nkv * hd :].reshape(S, nkv, hd)
        Q = rope(Q, pos_BS[b], cfg["rope_theta"])
        K = rope(K, pos_BS[b], cfg["rope_theta"])
        attn = torch.zeros(S, nh, hd, dtype=h_BSD.dtype)
        for doc in doc_BS[b].unique().tolist():
            if doc == -1:  # padding rows get zero attention output (§4.4 step 4)
                continue
            # positions of this document in sequence order
            idx = (doc_BS[b] == doc).nonzero().flatten()
            n = idx.numel()
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            for head in range(nh):
                q = Q[idx, head]
                k = K[idx, head // group]
                v = Vv[idx, head // group]
                scores = (q @ k.T) / math.sqrt(hd)
                scores = scores.masked_fill(~causal, float("-inf"))
                probs = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
                probs = probs / probs.sum(dim=-1, keepdim=True)
                attn[idx, head] = probs @ v
        A = (torch.sigmoid(G) * attn).reshape(S, nh * hd)
        out_BSD[b] = A @ w_o.T
    return out_BSD


def capacity(capacity_factor: float | None, N: int, k: int, E: int) -> int | None:
    """Per-expert capacity C = max(1, floor(cf·N·k/E)) of one MoE call; None (no dropping) if cf is 0."""
    if not capacity_factor:
        return None
    return max(1, math.floor(capacity_factor * N * k / E))


def swiglu(w13_2ID: Tensor, w2_DI: Tensor, v_D: Tensor) -> Tensor:
    """W_d (silu(W_g v) ⊙ W_u v) with W_g the first I rows of w13, W_u the next I rows."""
    I = w2_DI.shape[1]
    g = w13_2ID[:I] @ v_D
    up = w13_2ID[I:] @ v_D
    return w2_DI @ (torch.nn.functional.silu(g) * up)


def moe_branch(sd: dict, cfg: dict, l: int, t: int, u_BSD: Tensor, stats: dict | None) -> Tensor:
    """MoE(u) of §4.6: sigmoid router, biased selection, capacity keep rule, routed + shared SwiGLU."""
    B, S, D = u_BSD.shape
    N = B * S
    E = cfg["num_routed_experts"]
    k = cfg["top_k"] - (cfg["num_shared_experts"] if cfg["top_k_includes_shared"] else 0)
    router = sd[f"layers.{l}.moe.routers.{t - 1 if cfg['router_per_loop'] else 0}"]
    bias_E = sd[f"layers.{l}.moe.expert_bias"]
    u_ND = u_BSD.reshape(N, D)  # row-major over [B, S]: flat token index n = b·S + s

    chosen = []  # chosen[n] = list of k expert ids, slot order = descending biased score
    weight = []  # weight[n][j] = normalised unbiased score of slot j
    lse_sq = []
    for n in range(N):
        logits_E = router @ u_ND[n]
        lse_sq.append(torch.logsumexp(logits_E, dim=0) ** 2)
        s_E = torch.sigmoid(logits_E)
        sel_E = s_E + bias_E
        order = sorted(range(E), key=lambda e: (-sel_E[e].item(), e))[:k]
        total = max(sum(s_E[e].item() for e in order), GATE_SUM_FLOOR)
        chosen.append(order)
        weight.append([s_E[e] / total for e in order])

    counts_E = [0] * E
    for n in range(N):
        for e in chosen[n]:
            counts_E[e] += 1
    dropped = 0
    C = capacity(cfg["capacity_factor"], N, k, E)
    if C is not None:
        keep = [[True] * k for _ in range(N)]
        for e in range(E):
            assigned = [(n, j) for n in range(N) for j in range(k) if chosen[n][j] == e]
            if len(assigned) <= C:
                continue
            # keep the C largest normalised weights; ties go to the lower flat index n·k + j
            assigned.sort(key=lambda nj: (-weight[nj[0]][nj[1]].item(), nj[0] * k + nj[1]))
            for n, j in assigned[C:]:
                keep[n][j] = False
                dropped += 1
        if dropped:
            for n in range(N):
                survivors = [weight[n][j] for j in range(k) if keep[n][j]]
                total = sum(survivors) if survivors else 0.0
                weight[n] = [
                    (weight[n][j] / total if keep[n][j] else torch.zeros((), dtype=u_ND.dtype))
                    for j in range(k)
                ]
        counts_E = [min(c, C) for c in counts_E]

    w13_E2ID = sd[f"layers.{l}.moe.experts.w13"]
    w2_EDI = sd[f"layers.{l}.moe.experts.w2"]
    y_ND = torch.zeros_like(u_ND)
    for n in range(N):
        for j in range(k):
            if float(weight[n][j]) != 0.0:
                e = chosen[n][j]
                y_ND[n] += weight[n][j] * swiglu(w13_E2ID[e], w2_EDI[e], u_ND[n])
        for s in range(cfg["num_shared_experts"]):
            w13 = sd[f"layers.{l}.moe.shared_experts.{s}.w13.weight"]
            w2 = sd[f"layers.{l}.moe.shared_experts.{s}.w2.weight"]
            y_ND[n] += swiglu(w13, w2, u_ND[n])

    if stats is not None:
        stats.setdefault("dropped", 0)
        stats["dropped"] += dropped
        stats.setdefault("counts", {})[(l, t)] = counts_E
        stats.setdefault("z_sq", {})[(l, t)] = float(torch.stack(lse_sq).mean())
    return y_ND.reshape(B, S, D)


def reference_forward(
    sd: dict,
    cfg: dict,
    tokens_BS: Tensor,
    positions_BS: Tensor,
    doc_ids_BS: Tensor,
    loop_start: int = 1,
    loop_end: int | None = None,
    carry: tuple | None = None,
    dtype: torch.dtype = torch.float64,
    stats: dict | None = None,
) -> tuple[Tensor, tuple]:
    """LOOM forward for loops [loop_start, loop_end] (1-based, global), §4.9.

    sd: state dict with the CONTRACTS.md names; cfg: LoomModelArgs fields as a dict.
    carry: (z_BSD, h_num_BSD | None, h_den_BS1 | None) from a previous segment (None when
    loop_start == 1). Returns (logits_BSV in `dtype`, carry after loop_end). If `stats` is a dict
    it receives "dropped" (total capacity drops), "counts" {(l, t): kept per expert} and
    "z_sq" {(l, t): mean_n logsumexp(router logits)²}.
    """
    sd = {name: v.detach().to(dtype) for name, v in sd.items()}
    H, L, D = cfg["num_loops"], cfg["n_layers"], cfg["dim"]
    lam, eps = cfg["cycle_scale_lambda"], cfg["norm_eps"]
    beta = cfg["looping_residual_beta"]
    loop_end = H if loop_end is None else loop_end
    if loop_start == 1 and carry is not None:
        raise ValueError("carry must be None when loop_start == 1")
    if loop_start > 1 and carry is None:
        raise ValueError("loop_start > 1 needs the carry of loops [1, loop_start-1]")

    e_BSD = math.sqrt(D) * sd["tok_embeddings.weight"][tokens_BS]
    if carry is None:
        z = e_BSD
        h_num, h_den = None, None  # H-axis memory "empty"
    else:
        z = carry[0].detach().to(dtype)
        h_num = None if carry[1] is None else carry[1].detach().to(dtype)
        h_den = None if carry[2] is None else carry[2].detach().to(dtype)

    g_res = gamma(H, L, lam) if cfg["cycle_residual_scale"] else 1.0
    for t in range(loop_start, loop_end + 1):
        if t >= 2 and cfg["embed_inject_mode"] == "loop_start_mix_soft":
            g = inject_g(t, L, lam)
            z = (1 - g) * z + g * e_BSD
        l_num, l_den = None, None  # L-axis memory reset every loop
        for l in range(L):
            o = g_res * attention_branch(sd, cfg, l, rms(z, eps), positions_BS, doc_ids_BS)
            if cfg["looping_residual"]:
                l_num, l_den = ema_write(l_num, l_den, o, beta)
                r_l = ema_read(l_num, l_den)
                h_num, h_den = ema_write(h_num, h_den, r_l, beta)  # H memory fed with r_L
                r_h = ema_read(h_num, h_den)
                z = z + (r_h + r_l)  # x_plus_r: o enters only through the memories
            else:
                z = z + o
            m = moe_branch(sd, cfg, l, t, rms(z, eps), stats)
            if cfg["ffn_branch_rms"] == "affine":
                m = rms(m, eps, sd[f"layers.{l}.ffn_branch_norm.weight"])
            z = z + g_res * m
            if cfg.get("per_layer_out_norm", True):
                z = rms(z, eps)
        z = rms(z, eps)  # final norm at the end of every loop
    logits_BSV = z @ sd["output.weight"].T
    return logits_BSV, (z, h_num, h_den)
