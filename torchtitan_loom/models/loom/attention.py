"""Gated grouped-query attention with RoPE and document masks (LOOM_SPEC.md §4.4 steps 1-6).

Three interchangeable kernels compute the same math, chosen by `LoomModelArgs.attn_backend`:
- "sdpa": F.scaled_dot_product_attention with a boolean [B, 1, S, S] mask (the CPU reference);
- "flex": torch flex_attention with a BlockMask (GPU: always the compiled, fused kernel of
  flex_compiled.py; CPU: eager, forward only);
- "flash_attn": flash_attn_varlen_func over (row, document) segments (GPU, package required).
"auto" picks one of them per forward from the device and the compute dtype (resolve_attn_backend);
the mask's type then tells each layer which kernel it was built for (mask_backend). The device is
the tensors' unless a KernelTarget (target.py) names one.
A mask is built once per forward by `build_attention_mask` and reused by every layer and loop.
Incremental decoding (a `KVCache`) always runs the "sdpa" kernel: the new queries attend to the
cached keys of the same (layer, loop) plus their own, causally (one document per row).

A position attends to position j of the same row iff doc_ids are equal and j <= i. Documents are
contiguous runs in a row (the data contract); the varlen backend relies on that. Padding (doc id
-1) gets an exactly-zero attention output (LOOM_SPEC §4.4 step 4): the kernels let padding attend
among itself, which keeps every softmax row non-empty (no NaN, also for a fully padded row), and
`GatedAttention` then selects 0 for those queries, so nothing of padding reaches the stream.
GQA convention: query head h uses kv head h // (n_heads // n_kv_heads) (as flash-attn and
torch's enable_gqa do).

Legend: B batch rows, S sequence length, D model dim, H query heads, K kv heads, d head dim;
with a cache: N new positions, P cached + new key positions.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_loom.data_contract import PAD_DOC_ID
from torchtitan_loom.loop_request import KVAppender
from torchtitan_loom.models.loom.args import LoomModelArgs
from torchtitan_loom.models.loom.target import KernelTarget

# ---------------------------------------------------------------- RoPE


def rope_cos_sin(
    positions_BS: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [B, S, d] for rotate-half RoPE: angle = position * theta^(-2i/d), i < d/2, duplicated.

    Computed from the positions directly (no table), so there is no buffer to initialise and no
    maximum position.
    """
    device = positions_BS.device
    inv_freq_f = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    angle_BSf = positions_BS.to(torch.float32)[..., None] * inv_freq_f
    angle_BSd = torch.cat([angle_BSf, angle_BSf], dim=-1)
    return angle_BSd.cos(), angle_BSd.sin()


def apply_rope(x_BSHd: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor) -> torch.Tensor:
    """Rotate-half (GPT-NeoX) RoPE over the full head dim, in fp32, cast back to x's dtype."""
    x = x_BSHd.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos_BSd[:, :, None, :], sin_BSd[:, :, None, :]
    return (x * cos + rotated * sin).to(x_BSHd.dtype)


# ---------------------------------------------------------------- backend choice


def resolve_attn_backend(
    requested: str, device_type: str, dtype: torch.dtype, flash_available: bool
) -> str:
    """The kernel "auto" stands for: flash_attn varlen on CUDA in bf16/fp16 when importable, else
    flex on CUDA, sdpa elsewhere (flex has no backward on CPU). Other values are returned as is."""
    if requested != "auto":
        return requested
    if device_type != "cuda":
        return "sdpa"
    if flash_available and dtype in (torch.float16, torch.bfloat16):
        return "flash_attn"
    return "flex"


def mask_backend(mask: Any) -> str:
    """The backend a mask of build_attention_mask was built for (a static type test under compile)."""
    if isinstance(mask, torch.Tensor):
        return "sdpa"
    if isinstance(mask, tuple):
        return "flash_attn"
    return "flex"


# ---------------------------------------------------------------- masks


class AttentionMask(NamedTuple):
    """What every layer and loop of one forward needs to mask attention."""

    kernel: Any
    """Backend-specific document-causal mask (see build_attention_mask)."""
    real_BS11: torch.Tensor
    """bool [B, S, 1, 1]: True for real tokens; padding queries get a zero output."""


def build_attention_mask(backend: str, doc_ids_BS: torch.Tensor) -> AttentionMask:
    """Document-causal mask for one forward (reused by all layers and loops).

    kernel: sdpa -> bool [B, 1, S, S] (True = may attend); flex -> BlockMask;
    flash_attn -> (cu_seqlens int32 [segments+1], max_seqlen int) over the flattened [B*S] tokens.
    """
    real_BS11 = (doc_ids_BS != PAD_DOC_ID)[:, :, None, None]
    return AttentionMask(_kernel_mask(backend, doc_ids_BS), real_BS11)


def _kernel_mask(backend: str, doc_ids_BS: torch.Tensor) -> Any:
    B, S = doc_ids_BS.shape
    if backend == "sdpa":
        same_doc_BSS = doc_ids_BS[:, :, None] == doc_ids_BS[:, None, :]
        causal_SS = torch.ones(S, S, dtype=torch.bool, device=doc_ids_BS.device).tril()
        return (same_doc_BSS & causal_SS)[:, None]
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        def doc_causal(b, h, q_idx, kv_idx):
            return (doc_ids_BS[b, q_idx] == doc_ids_BS[b, kv_idx]) & (q_idx >= kv_idx)

        return create_block_mask(doc_causal, B, None, S, S, device=doc_ids_BS.device)
    if backend == "flash_attn":
        _import_flash_attn()
        # S bounds every segment; passing the bound avoids a second sync for the true maximum.
        return document_cu_seqlens(doc_ids_BS), S
    raise ValueError(f"attn_backend={backend!r} is not valid; choose one of sdpa, flex, flash_attn")


def document_cu_seqlens(doc_ids_BS: torch.Tensor) -> torch.Tensor:
    """int32 boundaries [segments + 1] of the (row, document) runs of the flattened [B*S] tokens."""
    B, S = doc_ids_BS.shape
    flat_N = doc_ids_BS.reshape(-1)
    starts_N = torch.ones_like(flat_N, dtype=torch.bool)
    starts_N[1:] = flat_N[1:] != flat_N[:-1]
    starts_N.view(B, S)[:, 0] = True  # a segment never spans two rows
    # Host sync, once per forward: the number of segments is data dependent.
    seg_starts = starts_N.nonzero().flatten()
    return torch.cat([seg_starts, seg_starts.new_tensor([B * S])]).to(torch.int32)


def _import_flash_attn():
    try:
        return importlib.import_module("flash_attn")
    except ImportError as err:
        raise ImportError(
            "attn_backend='flash_attn' needs the flash-attn package (pip install flash-attn, CUDA "
            "only); it is not importable here. Use attn_backend='sdpa' or 'flex'."
        ) from err


def build_cache_mask(past_len: int, new_len: int, device: torch.device) -> torch.Tensor:
    """bool [1, 1, new, past + new] for incremental decoding: new query i sees keys j <= past + i."""
    q_pos_N1 = torch.arange(past_len, past_len + new_len, device=device)[:, None]
    k_pos_1P = torch.arange(past_len + new_len, device=device)[None, :]
    return (k_pos_1P <= q_pos_N1)[None, None]


class KVCache:
    """Keys and values of every (layer, loop) already computed, for incremental decoding
    (a loop_request.DecodeCache).

    A LOOM layer runs once per loop with other inputs each time, so each (layer, loop) has its
    own K/V. The Looping-Residual memories are per position (no mixing across tokens), so a new
    position's memories are computed fresh and nothing else is cached. Tensors are [B, P, K, d].
    """

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def past_len(self, loop: int = 1) -> int:
        """Positions cached before this call, read from layer 0's slot of ``loop`` (the call's first
        loop): a call that continues loop by loop has already appended to the earlier loops'."""
        if not self.kv:
            return 0
        entry = self.kv.get((0, loop))
        if entry is None:
            raise ValueError(
                f"the cached positions were not run through loop {loop}: run the prompt through "
                "every loop that later calls use"
            )
        return entry[0].shape[1]

    def slot(self, layer: int, loop: int) -> KVSlot:
        """The handle one attention call appends to."""
        return KVSlot(self, (layer, loop))


class KVSlot:
    """One (layer, loop) entry of a KVCache: `append` adds the new K/V and returns all of them."""

    def __init__(self, cache: KVCache, key: tuple[int, int]) -> None:
        self.cache, self.key = cache, key

    def append(
        self, k_BSKd: torch.Tensor, v_BSKd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        old = self.cache.kv.get(self.key)
        if old is not None:
            k_BSKd, v_BSKd = torch.cat([old[0], k_BSKd], dim=1), torch.cat([old[1], v_BSKd], dim=1)
        self.cache.kv[self.key] = (k_BSKd, v_BSKd)
        return k_BSKd, v_BSKd


# ---------------------------------------------------------------- kernels


def attend(
    backend: str,
    q_BSHd: torch.Tensor,
    k_BSKd: torch.Tensor,
    v_BSKd: torch.Tensor,
    mask: Any,
    *,
    target: KernelTarget | None = None,
) -> torch.Tensor:
    """Softmax(q k^T / sqrt(d)) v under the document-causal `mask`; returns [B, S, H, d].

    k and v may be longer than q (cached keys first; "sdpa" only). `target`: the device the flex
    kernel is chosen for (None: the tensors').
    """
    B, S, H, d = q_BSHd.shape
    K = k_BSKd.shape[2]
    if backend == "sdpa":
        q, k, v = (t.transpose(1, 2) for t in (q_BSHd, k_BSKd, v_BSKd))
        # Expand kv heads explicitly: works with a boolean mask on every sdpa kernel.
        k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    if backend == "flex":
        device_type = q_BSHd.device.type if target is None else target.device_type
        flex = _flex_kernel(device_type)
        if (
            device_type == "cpu"
            and torch.is_grad_enabled()
            and (q_BSHd.requires_grad or k_BSKd.requires_grad or v_BSKd.requires_grad)
        ):
            raise RuntimeError(
                "attn_backend='flex' has no backward on CPU; use attn_backend='sdpa' for CPU "
                "training (flex works on CPU only under torch.no_grad())."
            )
        q, k, v = (t.transpose(1, 2) for t in (q_BSHd, k_BSKd, v_BSKd))
        call = flex if target is None else functools.partial(target.call, flex)
        return call(q, k, v, block_mask=mask, enable_gqa=H != K).transpose(1, 2)
    if backend == "flash_attn":
        flash_attn = _import_flash_attn()
        if q_BSHd.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"attn_backend='flash_attn' needs bf16/fp16 activations, got {q_BSHd.dtype}; "
                "enable mixed precision or use attn_backend='sdpa'."
            )
        cu_seqlens, max_seqlen = mask
        out_NHd = flash_attn.flash_attn_varlen_func(
            q_BSHd.reshape(B * S, H, d),
            k_BSKd.reshape(B * S, K, d),
            v_BSKd.reshape(B * S, K, d),
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            dropout_p=0.0,
            causal=True,
        )
        return out_NHd.view(B, S, H, d)
    raise ValueError(f"attn_backend={backend!r} is not valid; choose one of sdpa, flex, flash_attn")


def _flex_kernel(device_type: str):
    """The compiled flex_attention on CUDA (eager flex materialises the S x S scores there); the
    eager one elsewhere: CPU flex runs forward only (evaluation), where compiling buys nothing."""
    if device_type == "cuda":
        from torchtitan_loom.models.loom.flex_compiled import compiled_flex_attention

        return compiled_flex_attention
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


# ---------------------------------------------------------------- module


class GatedAttention(nn.Module):
    """h -> W_o (sigmoid(G) * Attn(RoPE(Q), RoPE(K), V)); fused projection order: gate, q, k, v heads."""

    def __init__(self, args: LoomModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.backend = args.attn_backend
        self.kernel_target: KernelTarget | None = None  # None: the tensors' device (see target.py)
        qkv_out = (2 * args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv_out, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(
        self,
        h_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMask,
        kv_slot: KVAppender | None = None,
    ) -> torch.Tensor:
        """Attention branch output a = W_o A (before the residual gain), [B, S, D].

        With `kv_slot` (a decoding cache's or an exit hold's, loop_request.KVStore) the keys and
        values go through it: with a cache, those of earlier positions come from it and `mask`
        holds a `build_cache_mask` kernel mask.
        """
        B, S, _ = h_BSD.shape
        H, K, d = self.n_heads, self.n_kv_heads, self.head_dim
        gate, q, k, v = self.wqkv(h_BSD).split([H * d, H * d, K * d, K * d], dim=-1)
        q_BSHd = apply_rope(q.view(B, S, H, d), *rope)
        k_BSKd = apply_rope(k.view(B, S, K, d), *rope)
        v_BSKd = v.view(B, S, K, d)
        backend = mask_backend(mask.kernel) if self.backend == "auto" else self.backend
        if kv_slot is not None:
            k_BSKd, v_BSKd = kv_slot.append(k_BSKd, v_BSKd)
            backend = "sdpa"
        attn_BSHd = attend(backend, q_BSHd, k_BSKd, v_BSKd, mask.kernel, target=self.kernel_target)
        # where, not a product: an exact 0 for padding queries whatever the kernel gave them.
        attn_BSHd = torch.where(mask.real_BS11, attn_BSHd, attn_BSHd.new_zeros(()))
        gated_BSHd = torch.sigmoid(gate.view(B, S, H, d)) * attn_BSHd
        return self.wo(gated_BSHd.reshape(B, S, H * d))
