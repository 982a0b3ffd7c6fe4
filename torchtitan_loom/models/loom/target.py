"""KernelTarget: the device the model picks its kernels for.

The model makes three device decisions: the attention kernel "auto" stands for, whether flex
attention runs compiled, and whether the routed experts take the grouped GEMM. By default each
forward decides from the device of its tensors. A `KernelTarget` set with
`LoomTransformer.set_kernel_target` names the device explicitly instead: that is how the CUDA path
is traced on CPU fake tensors (tests/unit/test_cuda_trace.py), where the tensors cannot be "cuda"
(FakeTensorMode on a CPU-only wheel cannot build autograd nodes for them).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def flash_attn_available() -> bool:
    """Whether the flash-attn package is installed (without importing it)."""
    return importlib.util.find_spec("flash_attn") is not None


@dataclass(frozen=True)
class KernelTarget:
    """Where the kernels run, for the model's kernel choices."""

    device_type: str
    """Device the decisions are made for ("cuda", "cpu", ...)."""
    flash_attn: bool
    """Whether the flash-attn package may be used."""
    run_kernel: Callable[..., Any] | None = None
    """How a fused kernel is called: None = `fn(*args, **kwargs)`. A trace on CPU fake tensors passes
    `run_kernel(fn, *args, **kwargs)` to stand in for kernels its tensors cannot run; it sees which
    function the model chose (e.g. the compiled or the eager flex attention)."""

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs), through `run_kernel` when one is set."""
        return (
            fn(*args, **kwargs) if self.run_kernel is None else self.run_kernel(fn, *args, **kwargs)
        )


def target_of(device_type: str) -> KernelTarget:
    """The default target of tensors on `device_type`: flash-attn counts on CUDA only."""
    return KernelTarget(device_type, device_type == "cuda" and flash_attn_available())
