"""LoomModelArgs: every knob of the LOOM model (LOOM_SPEC.md §1.1, §1.3, §14), validated.

The defaults are the recipe as it ran (spec §1.3 / §14); the size fields (vocab_size, dim,
n_layers, n_heads, n_kv_heads, expert_intermediate_size) have no default and come from a flavor
(see `models/loom/__init__.py`). The ablation switches are documented next to the recipe value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypedDict

EMBED_INJECT_MODES = ("none", "loop_start_mix_soft")
FFN_BRANCH_RMS_MODES = ("none", "affine")
ATTN_BACKENDS = ("auto", "sdpa", "flex", "flash_attn")
MOE_IMPLS = ("grouped", "loop")
# field -> its valid values; the config schema's [model] section reads them from here.
FIELD_CHOICES = {
    "embed_inject_mode": EMBED_INJECT_MODES,
    "ffn_branch_rms": FFN_BRANCH_RMS_MODES,
    "attn_backend": ATTN_BACKENDS,
    "moe_impl": MOE_IMPLS,
}
# Same math, or tunables a user may adjust mid-run: they may change between launches of one run
# (the spec's relaunch_tunable; the run folder reads them before torch is imported).
RELAUNCH_TUNABLE = (
    "attn_backend",
    "moe_impl",
    "capacity_factor",
    "load_balance_bias_lr",
    "router_z_loss_coef",
)


@dataclass(frozen=True, kw_only=True)
class LoomModelArgs:
    """Configuration of one LOOM model. Immutable: derive variants with `dataclasses.replace`."""

    # ---- sizes (spec §1.1) ----
    vocab_size: int
    """Vocabulary size V (rows of the embedding and of the output head)."""
    dim: int
    """Hidden size d of the residual stream."""
    n_layers: int
    """Number of physical blocks L, applied once per loop."""
    n_heads: int
    """Query (and output-gate) heads n_h; head_dim = dim // n_heads."""
    n_kv_heads: int
    """Key/value heads n_kv (grouped-query attention); must divide n_heads."""
    expert_intermediate_size: int
    """SwiGLU width I of every routed and shared expert."""
    num_loops: int = 9
    """Loops H: the L blocks are applied H times (spec §4.3). The `num_loops` ablation."""
    max_seq_len: int = 1023
    """Longest row length S the model accepts (pack seq_len 1024 minus the label shift)."""

    # ---- MoE (spec §4.6, §5) ----
    num_routed_experts: int = 30
    """Routed experts E per layer."""
    num_shared_experts: int = 2
    """Always-on SwiGLU experts per layer, added unweighted to the routed output."""
    top_k: int = 8
    """Experts per token; counts the shared experts when `top_k_includes_shared`."""
    top_k_includes_shared: bool = True
    """True: routed top-k = top_k - num_shared_experts (recipe: 8 - 2 = 6). False: routed = top_k."""
    capacity_factor: float = 1.5
    """Per-call capacity C = max(1, floor(capacity_factor * N * k / E)); 0 disables dropping."""
    load_balance_bias_lr: float = 2e-3
    """Step of the sign update of `expert_bias` (applied by the trainer, spec §5.2)."""
    router_z_loss_coef: float = 0.0
    """Coefficient of the router z-loss in `aux_loss`; 0 = the recipe as it ran (spec §5.1, §14)."""
    router_per_loop: bool = True
    """True: one router per loop (H separate parameters). False: one router per layer (ablation)."""

    # ---- loop schedule (spec §4.3) ----
    cycle_residual_scale: bool = True
    """True: branch writes scaled by gamma = lambda / (H sqrt(L)). False: gamma = 1 (ablation)."""
    cycle_scale_lambda: float = 0.5
    """lambda of the residual gain gamma and of the injection gate g_t = lambda / (t sqrt(L))."""
    embed_inject_mode: str = "loop_start_mix_soft"
    """'loop_start_mix_soft': z <- (1-g_t) z + g_t e at the start of loops t >= 2. 'none': no injection."""

    # ---- block (spec §4.4, §4.5) ----
    ffn_branch_rms: str = "affine"
    """'affine': MoE output passes RMS_w (learnable weight, init 1) before gamma. 'none': raw output."""
    looping_residual: bool = True
    """True: attention write x <- x + r_H + r_L (dual-axis EMA carry). False: plain x <- x + o."""
    looping_residual_beta: float = 0.5
    """EMA decay beta of both Looping-Residual memories (H axis and L axis)."""
    per_layer_out_norm: bool = True
    """True: x <- RMS(x) after every block (spec §12 item 3). False: no per-block output norm."""
    rope_theta: float = 10000.0
    """RoPE base theta (rotate-half convention over the full head dim)."""
    norm_eps: float = 1e-6
    """epsilon of every RMSNorm."""

    # ---- implementation choices (same math) ----
    attn_backend: str = "auto"
    """'auto' (per forward: flash_attn on CUDA in bf16/fp16 when importable, else flex on CUDA, sdpa
    on CPU; see attention.resolve_attn_backend), 'sdpa' (boolean document mask; CPU reference),
    'flex' (block mask; GPU), 'flash_attn' (varlen)."""
    moe_impl: str = "grouped"
    """'grouped': routed experts via torch._grouped_mm where usable. 'loop': per-expert matmul loop."""
    exit_head: bool = False
    """True: a learned per-token exit head (models/loom/exit_head.py: an MLP of (D + 2) x 64 + 65
    parameters) trained on the detached stream and prediction entropy to predict how much the next
    loops lower the token's loss; the exit criterion 'learned' of tools.depth, generate and
    lm_eval --exit reads it. False: no head."""
    init_seed: int = 0
    """Seed of the layout-independent init: each parameter's generator is seeded by (seed, name)."""

    @property
    def head_dim(self) -> int:
        """Per-head width h_d = dim // n_heads."""
        return self.dim // self.n_heads

    @property
    def routed_top_k(self) -> int:
        """Routed experts per token k (top_k minus the shared experts when they are included)."""
        if self.top_k_includes_shared:
            return self.top_k - self.num_shared_experts
        return self.top_k

    @property
    def num_routers(self) -> int:
        """Router matrices per layer: H with `router_per_loop`, else 1."""
        return self.num_loops if self.router_per_loop else 1

    def replace(self, **changes) -> LoomModelArgs:
        """Return a validated copy with `changes` applied."""
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and what would be valid."""
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "expert_intermediate_size",
            "num_loops",
            "max_seq_len",
            "num_routed_experts",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LoomModelArgs.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(
                f"LoomModelArgs.num_shared_experts must be an integer >= 0, got {self.num_shared_experts!r}"
            )
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"LoomModelArgs.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"LoomModelArgs.n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"LoomModelArgs.dim // n_heads = {self.head_dim} must be even (RoPE rotates pairs)"
            )
        k = self.routed_top_k
        if not 1 <= k <= self.num_routed_experts:
            extra = (
                f" (top_k minus num_shared_experts={self.num_shared_experts}, "
                "because top_k_includes_shared=True)"
                if self.top_k_includes_shared
                else ""
            )
            raise ValueError(
                f"LoomModelArgs.top_k={self.top_k} gives {k} routed experts per token{extra}; "
                f"valid: 1..num_routed_experts={self.num_routed_experts}"
            )
        _check_enum("embed_inject_mode", self.embed_inject_mode, EMBED_INJECT_MODES)
        _check_enum("ffn_branch_rms", self.ffn_branch_rms, FFN_BRANCH_RMS_MODES)
        _check_enum("attn_backend", self.attn_backend, ATTN_BACKENDS)
        _check_enum("moe_impl", self.moe_impl, MOE_IMPLS)
        for name in (
            "capacity_factor",
            "load_balance_bias_lr",
            "router_z_loss_coef",
            "cycle_scale_lambda",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"LoomModelArgs.{name} must be a number >= 0, got {value!r}")
        if not 0.0 <= self.looping_residual_beta <= 1.0:
            raise ValueError(
                f"LoomModelArgs.looping_residual_beta must be in [0, 1], got {self.looping_residual_beta!r}"
            )
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"LoomModelArgs.{name} must be a number > 0, got {value!r}")
        if not isinstance(self.init_seed, int) or self.init_seed < 0:
            raise ValueError(
                f"LoomModelArgs.init_seed must be an integer >= 0, got {self.init_seed!r}"
            )
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"LoomModelArgs.{name} must be true or false, got {getattr(self, name)!r}"
                )


_BOOL_FIELDS = (
    "top_k_includes_shared",
    "router_per_loop",
    "cycle_residual_scale",
    "looping_residual",
    "per_layer_out_norm",
    "exit_head",
)


def _check_enum(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(
            f"LoomModelArgs.{name}={value!r} is not valid; choose one of {', '.join(valid)}"
        )


class _Sizes(TypedDict):
    vocab_size: int
    num_loops: int
    max_seq_len: int


# The size presets (spec §1.1), torch-free: the config reads them before torch is imported.
_LOOM_SIZES = _Sizes(vocab_size=49152, num_loops=9, max_seq_len=1023)

loom_flavors = {
    # Tiny and CPU-fast: head_dim 64, 8 routed + 2 shared experts, 2 routed per token.
    "debug": LoomModelArgs(
        vocab_size=512,
        dim=128,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        num_loops=3,
        max_seq_len=256,
        num_routed_experts=8,
        num_shared_experts=2,
        top_k=4,
        expert_intermediate_size=128,
    ),
    # T_moe_L10: 313,863,168 parameters at H = 9.
    "loom_329m": LoomModelArgs(
        dim=512, n_layers=10, n_heads=8, n_kv_heads=4, expert_intermediate_size=512, **_LOOM_SIZES
    ),
    # T_moe_L15_E32: 1,644,913,920 parameters at H = 9.
    "loom_1p7b": LoomModelArgs(
        dim=1280,
        n_layers=15,
        n_heads=20,
        n_kv_heads=10,
        expert_intermediate_size=768,
        **_LOOM_SIZES,
    ),
}

for _args in loom_flavors.values():
    _args.validate()
FLAVORS = loom_flavors  # the name models/__init__.py's BUNDLED contract reads
