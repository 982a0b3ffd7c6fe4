"""The bf16 matmul peak of this device, measured in a few seconds: the ceiling MFU is also read
against (a datasheet peak is not reachable: a bf16 GEMM reaches ~80 % of it on an H200).

    python benchmarks/matmul_peak.py OUT_JSON [--cpu] [--seconds 3]

Square bf16 GEMMs of a few sizes, each timed over repeated calls after a warm-up (CUDA events);
the best TFLOP/s is the peak. --cpu: a small fp32 stand-in (the GPU check's --dry), not a peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SIZES = (4096, 8192, 16384)


def best_tflops(device: str, dtype: torch.dtype, sizes: tuple[int, ...], seconds: float) -> dict:
    results = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b  # warm-up: the library picks its kernel
        if device == "cuda":
            torch.cuda.synchronize()
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / len(sizes):
            for _ in range(10):
                a @ b
            reps += 10
            if device == "cuda":
                torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        results[n] = 2 * n**3 * reps / elapsed / 1e12
        del a, b
    n_best = max(results, key=results.get)
    return {
        "tflops": results[n_best],
        "size": n_best,
        "by_size": {str(k): v for k, v in results.items()},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--cpu", action="store_true", help="a small fp32 stand-in on the CPU")
    p.add_argument("--seconds", type=float, default=3.0)
    a = p.parse_args()
    if a.cpu:
        record = best_tflops("cpu", torch.float32, (256,), min(a.seconds, 1.0))
        record.update(device="cpu", dtype="float32", note="CPU stand-in, not a peak")
    elif not torch.cuda.is_available():
        print("matmul_peak: no CUDA device (use --cpu for the stand-in)", file=sys.stderr)
        return 2
    else:
        record = best_tflops("cuda", torch.bfloat16, SIZES, a.seconds)
        record.update(device=torch.cuda.get_device_name(), dtype="bfloat16")
    a.out.write_text(json.dumps(record, indent=1))
    print(
        f"matmul peak: {record['tflops']:.1f} TFLOP/s ({record['dtype']} {record['size']}^3 GEMM "
        f"on {record['device']})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
