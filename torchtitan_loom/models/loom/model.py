"""LoomTransformer: embedding, the loop schedule (gamma, g_t), loop ranges with a carried state,
untied head, layout-independent init (LOOM_SPEC.md §2-§4, §14).

    e = sqrt(d) * Emb[tokens];  z = e (loop 1) or the carried z
    for t in [loop_start, loop_end]:
        if t >= 2: z = (1 - g_t) z + g_t e           g_t = clamp(lambda / (t sqrt(L)), 0, 1)
        fresh L-axis memory; the H-axis memory is carried
        for each layer: z = Block(z; router t, gamma)  gamma = lambda / (H sqrt(L))
        z = RMS(z)
    logits = W_out z

Legend: B batch rows, S sequence length, D model dim, V vocab, L layers, T loops in the range,
E routed experts, K routed top-k, N observed branches per layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn

from torchtitan_loom.loop_request import DecodeCache, ExitHold, LoopRequest
from torchtitan_loom.models.loom.args import LoomModelArgs
from torchtitan_loom.models.loom.attention import (
    AttentionMask,
    KVCache,
    build_attention_mask,
    build_cache_mask,
    resolve_attn_backend,
    rope_cos_sin,
)
from torchtitan_loom.models.loom.block import BRANCHES, BlockOutput, LoomBlock, rms_norm
from torchtitan_loom.models.loom.counts import count_flops_per_token, count_params
from torchtitan_loom.models.loom.depth import check_beyond, check_inputs, router_index
from torchtitan_loom.models.loom.exit_head import ExitHead, prediction_entropy
from torchtitan_loom.models.loom.expert_bias import update_expert_bias
from torchtitan_loom.models.loom.kv_hold import KVHold
from torchtitan_loom.models.loom.loop_result import LoopCall, LoopRange, OneLoop
from torchtitan_loom.models.loom.looping_residual import LoopCarry, Memory, empty_memory
from torchtitan_loom.models.loom.moe import LoomMoE
from torchtitan_loom.models.loom.target import KernelTarget, target_of
from torchtitan_loom.models.loom.weight_init import init_parameters
from torchtitan_loom.protocols import ModelOutput, Routing

if TYPE_CHECKING:  # annotations only: a region's arguments and result keep their types
    from typing_extensions import TypeVarTuple, Unpack

    RegionArgs = TypeVarTuple("RegionArgs")
RegionResult = TypeVar("RegionResult")


def residual_gain(args: LoomModelArgs) -> float:
    """gamma = lambda / (H sqrt(L)), the same in every loop; 1 when cycle_residual_scale is off."""
    if not args.cycle_residual_scale:
        return 1.0
    return args.cycle_scale_lambda / (args.num_loops * math.sqrt(args.n_layers))


def inject_gain(t: int, args: LoomModelArgs) -> float:
    """g_t = clamp(lambda / (t sqrt(L)), 0, 1), the embedding weight at the start of loop t >= 2."""
    return min(1.0, max(0.0, args.cycle_scale_lambda / (t * math.sqrt(args.n_layers))))


def _past_len(req: LoopRequest, loop_start: int, new_len: int, max_seq_len: int) -> int:
    """Positions the request's cache holds before this call (0 without one), checked against
    the hold and max_seq_len."""
    if req.hold is not None and req.hold.cache is not req.cache:
        raise ValueError("hold must wrap the cache of the call (new_exit_hold(cache))")
    past = 0 if req.cache is None else req.cache.past_len(loop_start)
    if past + new_len > max_seq_len:
        raise ValueError(
            f"cached {past} + new {new_len} positions exceed max_seq_len={max_seq_len}"
        )
    return past


def _stack_asked(parts: Sequence[torch.Tensor | None], dim: int) -> torch.Tensor | None:
    """The parts stacked along `dim`; None when they were not asked for (every part None)."""
    asked = [p for p in parts if p is not None]
    return torch.stack(asked, dim=dim) if asked else None


class LoomTransformer(nn.Module):
    """The LOOM looped MoE language model (implements protocols.ModelProtocol)."""

    def __init__(self, args: LoomModelArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([LoomBlock(args) for _ in range(args.n_layers)])
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.exit_head = ExitHead(args.dim, args.num_loops) if args.exit_head else None
        # The one seam for code outside the model math (activation checkpointing): scope ("block",
        # "loop" or "segment" = the loops of one forward call) -> wrapper(fn, *args) that must
        # return fn(*args). Empty = plain calls. Set by distributed/activation_checkpoint.py.
        self.region_wrappers: dict[str, Callable[..., Any]] = {}
        self.kernel_target: KernelTarget | None = (
            None  # None: kernels chosen from the tensors' device
        )
        # Which router a loop past H uses (models/loom/depth.py); None refuses such loops.
        self.beyond_policy: str | None = None

    def set_kernel_target(self, target: KernelTarget | None) -> None:
        """Choose every kernel (attention backend, flex compiled or not, grouped GEMM) for
        `target.device_type` instead of the tensors' device; None restores the default."""
        self.kernel_target = target
        for layer in self._blocks():
            layer.attention.kernel_target = target
            layer.moe.experts.set_kernel_device(None if target is None else target.device_type)

    def set_beyond_policy(self, policy: str | None) -> None:
        """Allow loops past H with `policy`'s routers (protocols.BEYOND_POLICIES); None refuses them."""
        check_beyond(policy)
        self.beyond_policy = policy

    def new_exit_hold(self, cache: DecodeCache | None = None) -> ExitHold:
        """An empty hold for per-token exits (models/loom/kv_hold.py), over `cache` when decoding."""
        return KVHold(cache)

    @property
    def num_loops(self) -> int:
        """H."""
        return self.args.num_loops

    def moe_layers(self) -> Iterator[LoomMoE]:
        """The L MoE modules in layer order (each with its `expert_bias` buffer [E])."""
        return (layer.moe for layer in self._blocks())

    def _blocks(self) -> Iterable[LoomBlock]:
        """self.layers, typed (iterating an nn.ModuleList yields nn.Module)."""
        return cast("Iterable[LoomBlock]", self.layers)

    @property
    def routing(self) -> Routing:
        """(L, E) of the counts a forward returns per loop."""
        return Routing(self.args.n_layers, self.args.num_routed_experts)

    def carry_stream(self, carry: LoopCarry) -> torch.Tensor:
        """The stream z [B, S, D] after the carry's last loop."""
        return carry.z_BSD

    def exit_parameters(self) -> list[nn.Parameter]:
        """The learned exit head's parameters (model.exit_head), [] without one."""
        return [] if self.exit_head is None else list(self.exit_head.parameters())

    def exit_gain(self, carry: LoopCarry, loop: int) -> torch.Tensor:
        """[B, S] predicted drop of each token's loss (nats) over the loops after ``loop``, the
        carry's last (the learned exit, models/loom/exit_head.py); ValueError without the head."""
        if self.exit_head is None:
            raise ValueError("this model has no exit head (model.exit_head = true trains one)")
        if carry.entropy_BS is None:
            raise ValueError("this carry has no prediction entropy: it was made without the head")
        return self.exit_head(carry.z_BSD, carry.entropy_BS, loop)

    def stream_rms(self, carry: LoopCarry) -> torch.Tensor:
        """Per-token RMS [B, S] of the stream in the carry's last loop after its last block's
        update, before any norm (the last block's output norm, the loop's closing RMSNorm): after
        them it is 1 by construction."""
        return carry.rms_BS1[..., 0]

    def new_decode_cache(self) -> DecodeCache:
        """An empty cache for incremental decoding (components/evaluation/sampling.py)."""
        if self.args.capacity_factor != 0:
            raise ValueError(
                "incremental decoding needs capacity dropping off: build the model with "
                "capacity_factor=0 (with capacity on, a token's experts depend on the call size)"
            )
        return KVCache()

    def after_step(self, counts_LE: torch.Tensor) -> None:
        """protocols.UpdatesAfterStep: the sign update of every layer's `expert_bias` at step
        `load_balance_bias_lr` (spec §5.2), from the step's kept assignments per layer and expert."""
        update_expert_bias(self.moe_layers(), counts_LE, self.args.load_balance_bias_lr)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        tokens_BS: torch.Tensor,
        positions_BS: torch.Tensor,
        doc_ids_BS: torch.Tensor,
        loop_start: int = 1,
        loop_end: int | None = None,
        *,
        carry: LoopCarry | None = None,
        request: LoopRequest | None = None,
    ) -> ModelOutput:
        """Run loops [loop_start, loop_end] (1-based, global; loop_end None = H; past H only under
        a beyond policy, set_beyond_policy).

        loop_start = 1 starts from the embedding and needs carry=None; loop_start > 1 continues
        from `carry` (the state after loop_start - 1). `request` (loop_request.LoopRequest; None
        asks for nothing) names the optional modes: the routed expert ids (return_topk, analysis
        only), an observer of the branch outputs (observe), incremental decoding (cache: the
        tokens continue the cached positions of every row, one document per row, doc_ids ignored;
        their K/V are appended. Nothing else is cached: the Looping-Residual memories are per
        position, so the new positions start them fresh) and per-token exit (hold,
        models/loom/kv_hold.py: the K/V of the tokens it marks exited are held at their exit
        loop's; over the cache when decoding, hold.cache is cache). See protocols.ModelOutput
        for the fields.
        """
        args = self.args
        req = LoopRequest() if request is None else request
        loop_end = args.num_loops if loop_end is None else loop_end
        check_inputs(
            tokens_BS,
            positions_BS,
            doc_ids_BS,
            loop_start,
            loop_end,
            carry_z_BSD=None if carry is None else carry.z_BSD,
            max_seq_len=args.max_seq_len,
            num_loops=args.num_loops,
            beyond=self.beyond_policy,
        )
        past = _past_len(req, loop_start, tokens_BS.shape[1], args.max_seq_len)
        # The embedding is recomputed every call: later loops re-inject it (spec §6 item 2).
        e_BSD = self.tok_embeddings(tokens_BS) * math.sqrt(args.dim)
        if carry is None:
            z_BSD, h_mem = e_BSD, empty_memory(e_BSD)
        else:
            z_BSD, h_mem = carry.z_BSD, Memory(carry.h_num_BSD, carry.h_den_BS1)
        call = self._loop_call(e_BSD, positions_BS, doc_ids_BS, past, req)
        loops = self._region("segment", self._run_loops, loop_start, loop_end, z_BSD, h_mem, call)
        if args.router_z_loss_coef > 0:
            aux_loss = args.router_z_loss_coef * loops.z_sq_X.sum()
        else:
            aux_loss = torch.zeros((), dtype=torch.float32, device=e_BSD.device)
        logits_BSV = self.output(loops.z_BSD).float()
        head = self.exit_head
        return ModelOutput(
            logits_BSV,
            LoopCarry(
                loops.z_BSD,
                loops.h_mem.num_BSD,
                loops.h_mem.den_BS1,
                loops.rms_BS1,
                None if head is None else prediction_entropy(logits_BSV),
            ),
            aux_loss,
            counts_LTE=loops.counts_LTE,
            topk_LTBSK=loops.topk_LTBSK,
            observed_LTNK=loops.observed_LTNK,
            # Inside forward so FSDP's root unit has the head's parameters gathered.
            exit_gain_BS=None
            if head is None or carry is None
            else self.exit_gain(carry, loop_start - 1),
        )

    def _loop_call(
        self,
        e_BSD: torch.Tensor,
        positions_BS: torch.Tensor,
        doc_ids_BS: torch.Tensor,
        past: int,
        req: LoopRequest,
    ) -> LoopCall:
        """What every loop of the call reads (loop_result.LoopCall); `past`: cached positions."""
        args = self.args
        rope = rope_cos_sin(positions_BS, args.head_dim, args.rope_theta)
        if req.cache is None:
            attn_mask = build_attention_mask(self.attention_backend(e_BSD), doc_ids_BS)
        else:  # causal over the cached positions; every new position is a real query
            attn_mask = AttentionMask(
                build_cache_mask(past, doc_ids_BS.shape[1], doc_ids_BS.device),
                torch.ones_like(doc_ids_BS, dtype=torch.bool)[:, :, None, None],
            )
        gamma = torch.full((), residual_gain(args), dtype=torch.float32, device=e_BSD.device)
        kv = req.cache if req.hold is None else req.hold
        return LoopCall(e_BSD, rope, attn_mask, gamma, kv, req)

    def observed_branches(self) -> tuple[int, tuple[str, ...]]:
        """(L, names of the N branch outputs) of ModelOutput.observed_LTNK, in order."""
        return self.args.n_layers, BRANCHES

    def param_groups(self) -> dict[str, list[str]]:
        """Submodule -> its parameter names (per-submodule gradient norms): each layer's attention
        and MoE half (routers, experts, shared experts and the MoE-output norm), the embedding, the head."""
        groups: dict[str, list[str]] = {"embedding": [], "head": []}
        for i in range(self.args.n_layers):
            groups[f"layer_{i}.attention"], groups[f"layer_{i}.moe"] = [], []
        for name, _ in self.named_parameters():
            parts = name.split(".")
            if parts[0] == "layers":
                half = "attention" if parts[2] == "attention" else "moe"
                groups[f"layer_{parts[1]}.{half}"].append(name)
            else:
                groups["embedding" if parts[0] == "tok_embeddings" else "head"].append(name)
        return groups

    def attention_backend(self, e_BSD: torch.Tensor) -> str:
        """The attention kernel of this forward: args.attn_backend, "auto" resolved from the target
        device (the embedding's unless set_kernel_target named one) and the compute dtype (autocast's,
        else the embedding's: FSDP's param dtype)."""
        device_type = e_BSD.device.type
        target = self.kernel_target or target_of(device_type)
        dtype = (
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else e_BSD.dtype
        )
        return resolve_attn_backend(
            self.args.attn_backend, target.device_type, dtype, target.flash_attn
        )

    def _region(
        self,
        scope: str,
        fn: Callable[[Unpack[RegionArgs]], RegionResult],
        *fn_args: Unpack[RegionArgs],
    ) -> RegionResult:
        """fn(*fn_args), through the wrapper registered for `scope` if any (see region_wrappers)."""
        wrapper = self.region_wrappers.get(scope)
        return fn(*fn_args) if wrapper is None else wrapper(fn, *fn_args)

    def _run_loops(
        self, loop_start: int, loop_end: int, z_BSD: torch.Tensor, h_mem: Memory, call: LoopCall
    ) -> LoopRange:
        """Loops [loop_start, loop_end] from the stream and H-axis memory before loop_start."""
        per_loop: list[OneLoop] = []
        for t in range(loop_start, loop_end + 1):
            loop = self._region("loop", self._run_loop, t, z_BSD, h_mem, call)
            z_BSD, h_mem = loop.z_BSD, loop.h_mem
            per_loop.append(loop)
        return LoopRange(
            z_BSD=z_BSD,
            h_mem=h_mem,
            counts_LTE=torch.stack([loop.counts_LE for loop in per_loop], dim=1),
            z_sq_X=torch.cat([loop.z_sq_L for loop in per_loop]),
            topk_LTBSK=_stack_asked([loop.topk_LBSK for loop in per_loop], dim=1),
            observed_LTNK=_stack_asked([loop.observed_LNK for loop in per_loop], dim=1),
            rms_BS1=per_loop[-1].rms_BS1,
        )

    def _run_loop(self, t: int, z_BSD: torch.Tensor, h_mem: Memory, call: LoopCall) -> OneLoop:
        """Loop t (1-based): injection, the L blocks, the final RMSNorm."""
        args = self.args
        if t >= 2 and args.embed_inject_mode == "loop_start_mix_soft":
            g = inject_gain(t, args)
            z_BSD = (1.0 - g) * z_BSD + g * call.e_BSD
        l_mem = empty_memory(z_BSD)
        router = router_index(t, args.num_loops, args.router_per_loop, self.beyond_policy)
        observe = call.request.observe
        counts_per_layer, z_terms, topk_per_layer = [], [], []
        observed_per_layer: list[torch.Tensor] = []
        for i, layer in enumerate(self._blocks()):
            inp = call.block_input(None if call.kv is None else call.kv.slot(i, t))
            # Picked here, outside the block, so the block sees the router as a plain tensor.
            router_w_ED = layer.moe.routers[router]
            out: BlockOutput = self._region("block", layer, z_BSD, l_mem, h_mem, router_w_ED, inp)
            z_BSD, l_mem, h_mem = out.x_BSD, out.l_mem, out.h_mem
            counts_per_layer.append(out.kept_E)
            z_terms.append(out.z_sq)
            topk_per_layer.append(out.expert_BSK)
            # Outside the (compiled) block: observe is the caller's function.
            if observe is not None and out.branches is not None:
                observed_per_layer.append(torch.stack([observe(x_BSD) for x_BSD in out.branches]))
        return OneLoop(  # rms_BS1: the last block's, before its output norm and the loop's
            z_BSD=rms_norm(z_BSD, args.norm_eps),
            h_mem=h_mem,
            counts_LE=torch.stack(counts_per_layer),
            z_sq_L=torch.stack(z_terms),
            topk_LBSK=_stack_asked(topk_per_layer, dim=0),
            observed_LNK=_stack_asked(observed_per_layer, dim=0),
            rms_BS1=out.rms_BS1,
        )

    # ------------------------------------------------------------------ counts

    def param_counts(self) -> dict[str, int]:
        """{"total", "active"} parameters (models/loom/counts.py)."""
        return count_params(
            self.parameters(), self._blocks(), (self.tok_embeddings.weight, self.output.weight)
        )

    def flops_per_token(self, seq_len: int, head_calls: int = 1) -> float:
        """Training FLOPs per token over all H loops (models/loom/counts.py)."""
        return count_flops_per_token(
            self.args, self._blocks(), self.output.weight, seq_len, head_calls
        )

    # ------------------------------------------------------------------ init

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter from a generator seeded by (init_seed, canonical name).

        Each tensor is drawn on the CPU on its FULL shape, then copied in (for a DTensor, only this
        rank's shard), so the initial weights do not depend on device, world size or sharding.
        Router t >= 1 is drawn from router 0's seed: an exact copy (spec §3). `expert_bias` -> 0.
        """
        init_parameters(self.named_parameters(), self.args)
        for moe in self.moe_layers():
            moe.expert_bias.zero_()
