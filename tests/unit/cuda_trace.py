"""Tracing the CUDA path of one training segment on CPU fake tensors.

FakeTensorMode on the CPU-only wheel cannot build autograd nodes for "cuda" tensors, so the
tensors stay CPU fakes (shapes, dtypes and strides, no storage) and only the model's device
decisions are forced to their CUDA branch, through an explicit `KernelTarget("cuda", ...)`.
`AtenRecorder` records every aten op the forward, the loss and the backward dispatch.

Kernels a CPU fake cannot run are stood in for by what they compute on CUDA (`cuda_kernel`):
the compiled flex attention by the flex attention operator its graph holds (one fused kernel:
outputs only), the eager flex attention by its reference math (which materialises the scores).

Legend: B rows, S sequence length, L layers, T loops of the segment.
"""

from __future__ import annotations

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


class AtenRecorder(TorchDispatchMode):
    """Every aten op (and the flex attention operators) dispatched while active."""

    supports_higher_order_operators = True  # the flex attention operator passes through

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = getattr(getattr(func, "overloadpacket", func), "__name__", str(func))
        if name in HOST_SYNC_OPS and not (
            name == "repeat_interleave" and (kwargs or {}).get("output_size")
        ):
            raise AssertionError(f"host sync: aten.{name} reached (the segment's budget is 0)")
        out = func(*args, **(kwargs or {}))
        if name == "device":  # prim.device: a query, tens of thousands of them
            return out
        self.ops.append(
            Op(name, list(args), [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        )
        return out

    def named(self, *names: str) -> list[Op]:
        return [op for op in self.ops if op.name in names]


def cuda_kernel(fn, *args, **kwargs):
    """Stand-in for a kernel the CPU fakes cannot run: what `fn` computes on CUDA (KernelTarget.run_kernel)."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_op, sdpa_dense
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
    args, *, micro_batch: int, seq_len: int, loops: tuple[int, int], precision: str, convert=None
) -> tuple[AtenRecorder, Any]:
    """Forward loops [a, b] + the trainer's loss + backward of a fake `args`-shaped model, CUDA-forced.
    Returns the recorder and what `convert` returned.

    precision "autocast": one GPU (bf16 autocast, fp32 parameters); "fsdp": FSDP's bf16 parameters
    (the routers stay fp32: they are outside FSDP). `convert(model)` runs on the model first (a
    float8 converter).
    """
    B, S = micro_batch, seq_len
    with FakeTensorMode():
        model = LoomTransformer(args)  # fake parameters: shapes only, nothing allocated
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
        recorder = AtenRecorder()
        with recorder, torch.autocast("cpu", torch.bfloat16, enabled=precision == "autocast"):
            out = model(tokens, positions, doc_ids, loop_start=loops[0], loop_end=loops[1])
            loss = token_ce_sum(out.logits_BSV, labels) + out.aux_loss
        with recorder:
            loss.backward()
    return recorder, converted
