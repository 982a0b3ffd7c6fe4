"""What the float8 token pad costs, by arithmetic on a preset's shapes (not timed).

    python benchmarks/float8_pad_cost.py [--preset loom_1p7b_float8] [--micro-batch N]
    python benchmarks/float8_pad_cost.py --compiled 1016 128 384     # ~1 min on a CPU core

The preset's model is converted on meta tensors by Float8Converter as on an H200. With torchao's
`pad_inner_dim` (set when micro-batch x seq_len is not a multiple of 16), torchao's
`preprocess_addmm` copies both fp8 operands of each of a linear's three GEMMs through `F.pad`,
also where nothing is added (F.pad with zero padding still copies): forward x [M, K] and W [K, N],
grad-input g [M, N] and W^T [N, K], weight-gradient g^T [N, M] and x [M, K] (M padded). Each copy
reads and writes 1 byte per element. Bytes over the H200's datasheet HBM bandwidth, against the
GEMMs' FLOPs over its dense fp8 peak, bound what the pad costs in eager mode; a compiled graph may
fuse the pads into the quantisation kernels.

--compiled M K N measures what the compiled graph does instead, on the CPU (which has a real
float8 `torch._scaled_mm`): one Float8Linear, forward + backward under torch.compile, pad off and
on, at M tokens (not a multiple of 16); it counts inductor's generated kernels and the bytes of
the buffers its code allocates (a proxy for the extra HBM traffic a GPU graph would have).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan_loom.components.quantization.float8 import Float8Converter, plan_float8  # noqa: E402
from torchtitan_loom.config import load_config  # noqa: E402
from torchtitan_loom.config.validate import resolve_model_args  # noqa: E402
from torchtitan_loom.protocols import get_train_spec  # noqa: E402

H200_HBM_BYTES_S = 4.8e12  # datasheet
H200_FP8_FLOPS = 1979e12  # datasheet, dense


def pad_bytes(m: int, k: int, n: int) -> int:
    """HBM bytes the pads of one linear call move (read + write, fp8), M padded to 16."""
    mp = -(-m // 16) * 16
    return 2 * (m * k + k * n) + 2 * (m * n + n * k) + (n * m + n * mp) + (m * k + mp * k)


def compiled_pad_bytes(m: int, k: int, n: int) -> int:
    """The compiled graph's extra traffic per call, as --compiled measures it: one padded fp8
    copy of x [M', K] and of grad_out [M', N] (the weight-gradient operands), written and read."""
    mp = -(-m // 16) * 16
    return 2 * mp * (k + n)


def compiled_buffers(pad: bool, m: int, k: int, n: int) -> tuple[int, int, int]:
    """(generated kernels, buffers, bytes allocated) of one compiled float8 linear fwd + bwd."""
    import re

    from torch._inductor.utils import run_and_get_code
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch._dynamo.reset()
    lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(torch.bfloat16)
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name("tensorwise"), pad_inner_dim=pad
    )
    convert_to_float8_training(lin, config=config)
    step = torch.compile(lin)
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    _, codes = run_and_get_code(lambda: step(x).sum().backward())
    code = "\n".join(codes)
    buffers = re.findall(r"empty_strided_cpu\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)", code)
    total = 0
    for shape, dtype in buffers:
        numel = 1
        for d in (int(v) for v in shape.split(",") if v.strip()):
            numel *= d
        total += numel * getattr(torch, dtype).itemsize
    return len(re.findall(r"async_compile\.cpp_pybinding", code)), len(buffers), total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="loom_1p7b_float8")
    p.add_argument("--micro-batch", type=int, default=None, help="default: the preset's")
    p.add_argument("--compiled", type=int, nargs=3, metavar=("M", "K", "N"), default=None)
    a = p.parse_args()
    if a.compiled:
        for pad in (False, True):
            kernels, buffers, total = compiled_buffers(pad, *a.compiled)
            print(
                f"pad_inner_dim={pad}: {kernels} generated kernels, {buffers} buffers, "
                f"{total / 1e6:.2f} MB allocated"
            )
        return 0
    cfg = load_config(["--job.config_file", str(ROOT / "train_configs" / f"{a.preset}.toml")])
    tokens = (a.micro_batch or cfg.training.micro_batch_size) * cfg.training.seq_len
    spec = get_train_spec(cfg.model.name)
    plan, errors = plan_float8(
        dataclasses.replace(cfg.float8, experts=False), "cuda", (9, 0), "NVIDIA H200"
    )
    assert not errors, errors
    with torch.device("meta"):
        model = spec.model_cls(resolve_model_args(cfg)).to(torch.bfloat16)
    report = Float8Converter(plan, spec.float8_never_convert, None, tokens).convert(model)
    print(
        f"{a.preset}: {tokens} tokens per micro-batch, pad on: {report.padded_tokens is not None}"
    )
    print(
        "| linear (in -> out) | count | eager pad MB | fp8 GFLOP | eager pad / GEMM time "
        "| compiled pad MB | compiled pad / GEMM time |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    shapes: dict[tuple[int, int], int] = {}
    for fqn in report.dense:
        mod = model.get_submodule(fqn)
        key = (mod.in_features, mod.out_features)
        shapes[key] = shapes.get(key, 0) + 1
    total_pad_s = total_compiled_s = total_gemm_s = 0.0
    for (k, n), count in shapes.items():
        moved, flops = pad_bytes(tokens, k, n), 3 * 2 * tokens * k * n
        compiled = compiled_pad_bytes(tokens, k, n)
        pad_s, gemm_s = moved / H200_HBM_BYTES_S, flops / H200_FP8_FLOPS
        compiled_s = compiled / H200_HBM_BYTES_S
        total_pad_s += count * pad_s
        total_compiled_s += count * compiled_s
        total_gemm_s += count * gemm_s
        print(
            f"| {k} -> {n} | {count} | {moved / 1e6:.1f} | {flops / 1e9:.0f} "
            f"| {100 * pad_s / gemm_s:.1f} % | {compiled / 1e6:.1f} | {100 * compiled_s / gemm_s:.1f} % |"
        )
    print(
        f"all converted linears, one call each: fp8 GEMMs {1e6 * total_gemm_s:.0f} us at peak; "
        f"pad eager {1e6 * total_pad_s:.0f} us ({100 * total_pad_s / total_gemm_s:.1f} %), "
        f"compiled {1e6 * total_compiled_s:.0f} us ({100 * total_compiled_s / total_gemm_s:.1f} %)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
