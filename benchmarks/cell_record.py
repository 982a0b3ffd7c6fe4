"""What one throughput cell records beyond tokens/s: warm-up (compile) time and graph counts,
the spread of step times, the kernels the model chose, and a failure reason that says something.

Used by benchmarks/throughput.py (each cell) and benchmarks/gpu_summary.py (the goals).
"""

from __future__ import annotations

import statistics
from typing import Any

# The goals the GPU check reads the cells against (loom_1p7b at H = 9): bf16 compiled MFU against
# the datasheet peak, float8 / bf16 and compiled / eager tokens/s.
GOAL_MFU_PCT, GOAL_FLOAT8, GOAL_COMPILE = 50.0, 1.3, 1.2


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_times_s() -> list[float]:
    """Seconds of each graph compile dynamo finished in this process (one per compiled frame,
    inductor's code generation included), in order; [] where torch keeps no such metric."""
    try:
        from torch._dynamo.utils import compilation_time_metrics

        return [round(t, 3) for t in compilation_time_metrics.get("_compile.compile_inner", [])]
    except Exception:  # a private metric: the record is worth more than it
        return []


def progress_record(
    phase: str,
    now: float,
    build_s: float | None = None,
    warm_times: list[float] = (),  # type: ignore[assignment]
    timed_times: list[float] = (),  # type: ignore[assignment]
    graphs0: int | None = None,
) -> dict[str, Any]:
    """The record of a cell still running: the phase it is in, the steps it has done, the graphs
    compiled and each compile's time so far. Keys starting with "_" stay in memory (when the phase
    started, the graph count before the first step): a SIGTERM handler reads them."""
    return {
        "status": "running",
        "phase": phase,
        "build_s": build_s,
        "warmup_step_times_s": list(warm_times),
        "warmup_first_step_s": warm_times[0] if warm_times else None,
        "timed_step_times_s": list(timed_times),
        "steps_done": len(warm_times) + len(timed_times),
        "graphs_compiled": None if graphs0 is None else compiled_graphs() - graphs0,
        "compile_times_s": compile_times_s(),
        "_phase_started": now,
        "_graphs0": graphs0,
    }


def progress_note(cell: dict[str, Any]) -> str:
    """One line of how far a cell that did not finish got (empty for a finished one)."""
    if cell.get("status") in ("ok", None) or "steps_done" not in cell:
        return ""
    compiles = cell.get("compile_times_s") or []
    return (
        f"{cell.get('steps_done')} steps done (warm-up s: "
        f"{', '.join(f'{t:.1f}' for t in cell.get('warmup_step_times_s') or []) or 'none'}); "
        f"build {_fmt(cell.get('build_s'), '.1f')} s; "
        f"{len(compiles)} graph compiles finished"
        + (f" ({', '.join(f'{t:.1f}' for t in compiles)} s)" if compiles else "")
        + f"; cut during {cell.get('phase', '?')}"
    )


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def spread(times_s: list[float]) -> dict[str, float | None]:
    """min / median / max of the timed steps, seconds."""
    if not times_s:
        return {"step_time_min_s": None, "step_time_median_s": None, "step_time_max_s": None}
    return {
        "step_time_min_s": min(times_s),
        "step_time_median_s": statistics.median(times_s),
        "step_time_max_s": max(times_s),
    }


def kernels(trainer: Any, device_type: str, compiling: bool) -> dict[str, str]:
    """The attention backend and the routed experts' kernel the model chose on this device."""
    lines = []
    try:  # a report is worth less than the cell: never let it fail the measurement
        if trainer.parts.setting.spec.kernel_report_fn is not None:
            lines = trainer.parts.setting.spec.kernel_report_fn(
                trainer.model, device_type, trainer.parts.setting.compute_dtype, compiling
            )
    except Exception as exc:
        return {"attention": f"unknown ({failure_reason(exc)})", "expert_kernel": "unknown"}
    attention = next((ln for ln in lines if ln.startswith("attention backend:")), "unknown")
    fallbacks = [ln for ln in lines if "per-expert loop" in ln]
    from torchtitan_loom.protocols import GroupedKernel

    experts = {
        m.kernel.name
        for m in trainer.model.modules()
        if isinstance(getattr(m, "kernel", None), GroupedKernel)
    }
    if fallbacks:
        expert = f"per-expert loop ({len(fallbacks)} layers; {fallbacks[0]})"
    elif experts - {None}:
        expert = f"float8 grouped GEMM {', '.join(sorted(experts - {None}))}"
    else:
        expert = (
            f"torch._grouped_mm ({str(trainer.parts.setting.compute_dtype).removeprefix('torch.')})"
        )
    return {"attention": attention.removeprefix("attention backend: "), "expert_kernel": expert}


def failure_reason(exc: BaseException) -> str:
    """`Type: message` of the innermost cause, with the outer type when it wraps one: an inductor
    failure reads `BackendCompilerFailed -> AssertionError: ...`, not `backend='inductor' raised:`."""
    chain, seen = [exc], {id(exc)}
    while True:
        inner = getattr(chain[-1], "inner_exception", None) or chain[-1].__cause__
        if inner is None or id(inner) in seen:
            break
        chain.append(inner)
        seen.add(id(inner))
    root = chain[-1]
    lines = [ln.strip() for ln in str(root).splitlines() if ln.strip()]
    # Skip wrapper boilerplate lines ("backend='inductor' raised:", "Set TORCH_LOGS=...").
    text = next(
        (ln for ln in lines if not ln.endswith("raised:") and not ln.startswith("Set TORCH")),
        lines[0] if lines else "",
    )
    head = " -> ".join(type(e).__name__ for e in chain[:-1])
    reason = f"{type(root).__name__}: {text}"[:300]
    return f"{head} -> {reason}" if head else reason


def mfu_measured(tflops: float | None, measured_peak_tflops: float | None) -> float | None:
    """MFU (%) against the bf16 matmul peak measured on this device (benchmarks/matmul_peak.py)."""
    if tflops is None or not measured_peak_tflops:
        return None
    return 100.0 * tflops / measured_peak_tflops
