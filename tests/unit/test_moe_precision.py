"""bf16 reaches the experts (issue 12, item 1): the GEMM-path rule as a pure function (its CUDA
cases included), routed and shared experts computing in bf16 under single-process autocast with
the grouped GEMM and no host sync, while the router, the Looping-Residual memories, the carry and
RoPE stay fp32 (LOOM_SPEC precision notes); the per-layer fallback lines of the run log."""

import pytest
import torch
from batches import two_document_batch  # tests/unit/batches.py
from torch.overrides import TorchFunctionMode

from torchtitan_loom.models.loom import LoomTransformer, loom_flavors
from torchtitan_loom.models.loom.moe import gemm_path, moe_gemm_fallbacks

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16


@pytest.mark.parametrize(
    "device, dtype, compiling, dim, inter, impl, want",
    [
        ("cuda", BF16, False, 64, 32, "grouped", "grouped"),
        ("cuda", BF16, True, 64, 32, "grouped", "grouped"),
        ("cuda", FP32, False, 64, 32, "grouped", "loop"),  # what main did under autocast
        ("cuda", FP32, True, 64, 32, "grouped", "loop"),
        ("cuda", FP16, False, 64, 32, "grouped", "loop"),
        (
            "cuda",
            BF16,
            False,
            64,
            36,
            "grouped",
            "loop",
        ),  # 36 bf16 values = 72 bytes: not 16-aligned
        ("cuda", BF16, False, 64, 32, "loop", "loop"),
        ("cpu", FP32, False, 64, 32, "grouped", "grouped"),  # CPU eager takes fp32
        ("cpu", FP32, True, 64, 32, "grouped", "loop"),  # the compile-time check wants bf16
        ("cpu", BF16, True, 64, 32, "grouped", "grouped"),
    ],
)
def test_gemm_path_is_a_function_of_device_dtype_compiling_and_shapes(
    device, dtype, compiling, dim, inter, impl, want
):
    path, why = gemm_path(device, dtype, compiling, dim, inter, impl)
    assert path == want, why
    if want == "loop":
        assert why and why != "grouped GEMM"


class _Calls(TorchFunctionMode):
    """Records (function name, dtypes of its tensor arguments)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(
            (getattr(func, "__name__", ""), [a.dtype for a in args if isinstance(a, torch.Tensor)])
        )
        return func(*args, **(kwargs or {}))


_batch = two_document_batch


def test_experts_compute_in_bf16_under_autocast_and_the_spec_fp32_parts_stay_fp32():
    model = LoomTransformer(loom_flavors["debug"].replace(num_loops=2))
    model.init_weights()
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen.setdefault(name, set()).add(
                output[0].dtype if isinstance(output, tuple) else output.dtype
            )

        return hook

    layer = model.layers[0]
    layer.moe.experts.register_forward_hook(record("routed"))
    layer.moe.shared_experts[0].register_forward_hook(record("shared"))
    layer.register_forward_hook(
        lambda m, i, out: seen.update(
            l_mem={out.l_mem.num_BSD.dtype, out.l_mem.den_BS1.dtype},
            h_mem={out.h_mem.num_BSD.dtype},
        )
    )
    with _Calls() as mode, torch.autocast("cpu", dtype=BF16):
        out = model(*_batch())
    assert seen["routed"] == {BF16} and seen["shared"] == {BF16}
    assert seen["l_mem"] == {FP32} and seen["h_mem"] == {FP32}
    assert out.carry.h_num_BSD.dtype == FP32 and out.carry.h_den_BS1.dtype == FP32
    assert out.carry.z_BSD.dtype == FP32
    names = [name for name, _ in mode.calls]
    grouped = [dtypes for name, dtypes in mode.calls if name == "_grouped_mm"]
    # 2 layers x 2 loops x 2 grouped GEMMs, all on bf16 rows and bf16 weights; the per-expert
    # loop's host sync never ran.
    assert len(grouped) == 8 and all(d[:2] == [BF16, BF16] for d in grouped), grouped
    assert "tolist" not in names
    # The router's logits are fp32 under autocast (test_model_moe checks route() itself); RoPE
    # tables are built in fp32 and apply_rope rotates in fp32 (test_model_attention).


def test_fallback_lines_name_the_layer_and_the_reason():
    args = loom_flavors["debug"].replace(num_loops=2)
    model = LoomTransformer(args)
    assert moe_gemm_fallbacks(model.moe_layers(), "cuda", BF16, compiling=True) == []
    lines = moe_gemm_fallbacks(model.moe_layers(), "cuda", FP32, compiling=False)
    assert (
        len(lines) == args.n_layers and lines[1].startswith("layer 1:") and "bfloat16" in lines[1]
    )
    loop = LoomTransformer(args.replace(moe_impl="loop"))
    assert all(
        "moe_impl='loop'" in line
        for line in moe_gemm_fallbacks(loop.moe_layers(), "cuda", BF16, False)
    )
