"""Tracing the CUDA path of one training segment on CPU fake tensors.

FakeTensorMode on the CPU-only wheel cannot build autograd nodes for "cuda" tensors, so the
tensors stay CPU fakes (shapes, dtypes and strides, no storage) and only the model's device
decisions are forced to their CUDA branch, through an explicit `KernelTarget("cuda", ...)`.
`AtenRecorder` records every aten op the forward, the loss and the backward dispatch.

Kernels a CPU fake cannot run are stood in for by what they compute on CUDA (`cuda_kernel`):
the compiled flex attention by the flex attention operator its graph holds (one fused kernel:
outputs only), the eager flex attention by its reference math (which materialises the scores).

A CPU fake also skips the shape rules some CUDA kernels' meta functions check only off the CPU
(torch._scaled_mm's inner dim divisible by 16, torch._grouped_mm's 16-byte strides), so
`replay_on_meta` runs every recorded GEMM again on meta tensors of the same shapes, strides,
offsets and dtypes (float8 tensors rebuilt around meta data), where those rules are checked.

Legend: B rows, S sequence length, L layers, T loops of the segment.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchtitan_loom.components.loss import token_ce_sum
from torchtitan_loom.models.loom import LoomTransformer
from torchtitan_loom.models.loom.target import KernelTarget

GEMMS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm")
# Ops whose result the host must wait for (a value or a data-dependent shape).
HOST_SYNC_OPS = (
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "is_nonzero",
    "equal",
    "repeat_interleave",
)


@dataclass
class Op:
    name: str  # overload packet name, e.g. "mm", "_grouped_mm"
    args: list[Any]  # positional arguments (tensors are fakes)
    outputs: list[torch.Tensor]
    func: Any = None
    kwargs: dict[str, Any] | None = None


class AtenRecorder(TorchDispatchMode):
    """Every aten op (and the flex attention operators) dispatched while active."""

    supports_higher_order_operators = True  # the flex attention operator passes through

    def __init__(self, host_syncs: bool = False) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.host_syncs = host_syncs  # True: allowed (the optimizer's CPU step counters)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = getattr(getattr(func, "overloadpacket", func), "__name__", str(func))
        if (
            not self.host_syncs
            and name in HOST_SYNC_OPS
            and not (name == "repeat_interleave" and (kwargs or {}).get("output_size"))
        ):
            raise AssertionError(f"host sync: aten.{name} reached (the segment's budget is 0)")
        out = func(*args, **(kwargs or {}))
        if name == "device":  # prim.device: a query, tens of thousands of them
            return out
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append(Op(name, list(args), outputs, func, dict(kwargs or {})))
        return out

    def named(self, *names: str) -> list[Op]:
        return [op for op in self.ops if op.name in names]


def cuda_kernel(fn, *args, **kwargs):
    """Stand-in for a kernel the CPU fakes cannot run: what `fn` computes on CUDA (KernelTarget.run_kernel)."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_op
    from torch._higher_order_ops.flex_attention import sdpa_dense
    from torch.nn.attention.flex_attention import _identity, flex_attention

    from torchtitan_loom.models.loom.flex_compiled import compiled_flex_attention

    if fn is compiled_flex_attention or fn is flex_attention:
        q, k, v = args
        mask = kwargs["block_mask"].as_tuple()
        scale = q.shape[-1] ** -0.5
        # compiled: the one fused operator; eager (on CUDA too): the reference math.
        op = flex_op if fn is compiled_flex_attention else sdpa_dense
        return op(q, k, v, _identity, mask, scale, {})[0]
    raise AssertionError(f"no CUDA stand-in for {getattr(fn, '__name__', fn)}")


CUDA = KernelTarget(
    "cuda", flash_attn=False, run_kernel=cuda_kernel
)  # the GPU image has no flash-attn


def trace_segment(
    args,
    *,
    micro_batch: int,
    seq_len: int,
    loops: tuple[int, int],
    precision: str,
    convert=None,
    optimizer=None,
    host_syncs: bool = False,
    fake: bool = True,
) -> tuple[AtenRecorder, Any]:
    """Forward loops [a, b] + the trainer's loss + backward of a fake `args`-shaped model, CUDA-forced.
    Returns the recorder and what `convert` returned.

    precision "autocast": one GPU (bf16 autocast, fp32 parameters); "fsdp": FSDP's bf16 parameters
    (the routers stay fp32: they are outside FSDP); "fp32": no autocast, fp32 parameters.
    `convert(model)` runs on the model first (a float8 converter). `optimizer` (an [optimizer]
    config section): then the trainer's clip and AdamW step, recorded in `recorder.step_ops`
    (host syncs allowed there: AdamW reads its step counters, CPU tensors on a GPU run too).
    `host_syncs`: allow them in the segment too (a layout with a documented per-call sync).
    `fake=False`: real CPU tensors (initialised weights) for a path that reads values on the host,
    which a fake cannot give (the per-expert loop); for small models only.
    """
    B, S = micro_batch, seq_len
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = LoomTransformer(args)  # fake parameters: shapes only, nothing allocated
        if not fake:
            with torch.no_grad():
                model.init_weights()
        converted = convert(model) if convert is not None else None
        model.set_kernel_target(CUDA)
        if precision == "fsdp":
            for name, p in model.named_parameters():
                if ".routers." not in name:
                    p.data = p.data.to(torch.bfloat16)
        tokens = torch.randint(0, args.vocab_size, (B, S))
        positions = torch.arange(S).expand(B, S)
        doc_ids = torch.zeros(B, S, dtype=torch.long)
        labels = torch.randint(0, args.vocab_size, (B, S))
        recorder = AtenRecorder(host_syncs)
        with recorder, torch.autocast("cpu", torch.bfloat16, enabled=precision == "autocast"):
            out = model(tokens, positions, doc_ids, loop_start=loops[0], loop_end=loops[1])
            loss = token_ce_sum(out.logits_BSV, labels) + out.aux_loss
        with recorder:
            loss.backward()
        recorder.step_ops = []
        if optimizer is not None:
            optimizer_step(model, optimizer, recorder)
    return recorder, converted


def optimizer_step(model, section, recorder: AtenRecorder) -> None:
    """The trainer's segment end: global norm (no host sync), clip, AdamW step."""
    from torchtitan_loom.components.optim.optimizer import build_optimizer
    from torchtitan_loom.distributed.utils import clip_grads_with_total_norm, grad_norm_sq_pieces

    params = [p for p in model.parameters() if p.requires_grad]
    with recorder:
        norm_sq = grad_norm_sq_pieces([p.grad for p in params if p.grad is not None], 1).sum()
        clip_grads_with_total_norm(params, norm_sq, 1.0)
    recorder.stepped = [p for p in params if p.grad is not None]
    opt = build_optimizer(model, section)
    step = AtenRecorder(host_syncs=True)
    with step:
        opt.step()
    recorder.step_ops = step.ops


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `t`'s shape, strides, storage offset and dtype (no data)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__") and not _is_fake(t):
        names, ctx = t.__tensor_flatten__()  # a tensor subclass (float8): rebuild around meta
        inner = {n: _meta_like(getattr(t, n)) for n in names}
        return type(t).__tensor_unflatten__(inner, ctx, t.shape, t.stride())
    span = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n) + 1
    base = torch.empty(span if t.numel() else 0, dtype=t.dtype, device="meta")
    return base.as_strided(t.shape, t.stride(), t.storage_offset()) if t.numel() else base


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def replay_on_meta(ops: list[Op]) -> int:
    """Run each distinct recorded op again on meta tensors (the CUDA kernels' shape rules);
    raises AssertionError naming the op and its operands when one breaks a rule. Returns how
    many distinct calls ran."""

    def meta(x):
        return _meta_like(x) if isinstance(x, torch.Tensor) else x

    def signature(x):
        if isinstance(x, torch.Tensor):
            return (type(x).__name__, x.dtype, tuple(x.shape), x.stride(), x.storage_offset())
        return repr(x)

    seen = set()
    for op in ops:
        key = (op.name, *map(signature, op.args), *map(signature, (op.kwargs or {}).values()))
        if key in seen:
            continue
        seen.add(key)
        args = [meta(a) for a in op.args]
        kwargs = {k: meta(v) for k, v in (op.kwargs or {}).items()}
        try:
            op.func(*args, **kwargs)
        except RuntimeError as exc:
            shapes = [(tuple(a.shape), a.stride(), a.dtype) for a in args if hasattr(a, "shape")]
            raise AssertionError(f"aten.{op.name} {shapes}: {exc}") from exc
    return len(seen)
