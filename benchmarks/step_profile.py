"""Profile training steps with torch.profiler: a Chrome trace, and the share of step time spent in
GEMMs, attention, all-to-all and everything else (used by `throughput.py --profile`).

Shares are self times of the profiled ops (device kernels on CUDA, CPU ops otherwise), summed by
category, over the wall time of the profiled steps; "other" is the rest of the wall time
(elementwise ops, norms, optimizer, Python, and on CUDA idle time such as host syncs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# Lower-cased substrings of op / kernel names, per category (first match wins).
CATEGORIES = {
    "all_to_all": ("all_to_all", "alltoall", "sendrecv"),
    "attention": (
        "scaled_dot_product",
        "flash",
        "flex_attention",
        "fmha",
        "efficient_attention",
        "attention",
    ),
    "gemm": (
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "grouped_mm",
        "scaled_mm",
        "gemm",
        "cutlass",
        "xmma",
        "cublas",
        "wgmma",
    ),
}


def categorize(name: str) -> str:
    """The category of one profiled op or kernel name ("other" when none matches)."""
    lowered = name.lower()
    for category, keys in CATEGORIES.items():
        if any(key in lowered for key in keys):
            return category
    return "other"


def profile_steps(
    step: Callable[[], object], steps: int, trace_path: Path, device: torch.device
) -> dict[str, float]:
    """Run `step()` `steps` times under the profiler; write the Chrome trace; return the shares
    {gemm, attention, all_to_all, other} (fractions of the wall time, summing to 1) and step_time_s."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall_us = (time.perf_counter() - start) * 1e6
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    on_device = device.type == "cuda"
    spent = {category: 0.0 for category in CATEGORIES}
    for event in prof.key_averages():
        category = categorize(event.key)
        if category == "other":
            continue
        # Device kernels on CUDA (CPU-side launches of the same op would count it twice).
        spent[category] += event.self_device_time_total if on_device else event.self_cpu_time_total
    shares = {category: min(spent[category] / wall_us, 1.0) for category in CATEGORIES}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    shares["step_time_s"] = wall_us / 1e6 / steps
    return shares
