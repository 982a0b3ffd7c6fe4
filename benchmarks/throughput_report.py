"""The Markdown table of benchmarks/throughput.py, and the facts of the device it ran on."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

PROFILE_STEPS = 2  # profiled steps per cell with --profile


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown(meta: dict[str, Any], cells: list[dict[str, Any]]) -> str:
    lines = [
        f"Preset `{meta['preset']}` on {meta['device_name']}: global batch {meta['global_batch_size']} x "
        f"seq {meta['seq_len']}, {meta['steps']} timed steps after {meta['warmup']} warm-up; torch "
        f"{meta['torch']}, torchao {meta['torchao']}.",
        "",
        "| precision | compile | AC | status | tokens/s | TFLOP/s | MFU % | MFU % of measured "
        "| warm-up 1st step s | step s min / median / max | peak alloc / reserved GiB | final loss |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        status = c["status"] if c["status"] == "ok" else f"{c['status']}: {c.get('reason', '')}"
        lines.append(
            f"| {c['precision']} | {c['compile']} | {c['ac']} | {status} "
            f"| {_fmt(c.get('tokens_per_s'), ',.0f')} "
            f"| {_fmt(c.get('tflops'), '.3f')} | {_fmt(c.get('mfu'), '.1f')} "
            f"| {_fmt(c.get('mfu_measured_peak'), '.1f')} | {_fmt(c.get('warmup_first_step_s'), '.1f')} "
            f"| {_fmt(c.get('step_time_min_s'), '.3f')} / {_fmt(c.get('step_time_median_s'), '.3f')} "
            f"/ {_fmt(c.get('step_time_max_s'), '.3f')} "
            f"| {_fmt(c.get('peak_memory_gib'), '.2f')} / {_fmt(c.get('peak_reserved_gib'), '.2f')} "
            f"| {_fmt(c.get('final_loss'), '.4f')} |"
        )
    profiled = [c for c in cells if "profile" in c]
    if profiled:
        lines += [
            "",
            f"Profile of {PROFILE_STEPS} steps per cell (share of step time; traces under "
            "`<out>/traces/`):",
            "",
            "| precision | compile | AC | step s | GEMM % | attention % | all-to-all % | other % |",
            "|---|---|---|---:|---:|---:|---:|---:|",
        ]
        for c in profiled:
            p = c["profile"]
            lines.append(
                f"| {c['precision']} | {c['compile']} | {c['ac']} | {p['step_time_s']:.3f} "
                f"| {100 * p['gemm']:.1f} | {100 * p['attention']:.1f} | {100 * p['all_to_all']:.1f} "
                f"| {100 * p['other']:.1f} |"
            )
    lines += ["", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def format_shares(shares: dict[str, float]) -> str:
    parts = ", ".join(
        f"{k} {100 * shares[k]:.1f}%" for k in ("gemm", "attention", "all_to_all", "other")
    )
    return f"step {shares['step_time_s']:.3f} s: {parts}"


def device_meta(cpu: bool) -> dict[str, Any]:
    if not cpu and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        return {"device_name": torch.cuda.get_device_name(), "capability": f"SM{cap[0]}{cap[1]}"}
    return {
        "device_name": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} threads)",
        "capability": None,
    }
