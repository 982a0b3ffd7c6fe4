"""The dry run's cost estimate: per-rank memory, communication per step, FLOPs, and a roofline step
time and MFU, for any layout of any world size, plus the fastest layout that fits in memory.

Model-specific numbers (FSDP units, FLOPs and activation bytes per segment) come from the spec's
``cost_fn``; the collectives from ``comm_plan.predict``. The roofline, with every assumption under
``[estimate]`` and printed with the result:

  compute    (model FLOPs + recompute FLOPs) / (peak_tflops × achievable_fraction)
  collective calls × (latency_us + bus bytes / bandwidth), bus bytes = bytes × (n−1)/n for
             all-gather, reduce-scatter and all-to-all, × 2(n−1)/n for all-reduce (ring); bandwidth
             intra_node_gbps when the group's ranks lie in one node of gpus_per_node, else
             inter_node_gbps
  step       max(compute, FSDP collectives) + the rest: FSDP prefetches its gathers and reduces
             behind the compute, while the expert all-to-alls, the replicated-parameter and step-statistic
             all-reduces sit on the critical path
  MFU        model FLOPs / (step × peak_tflops)
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from torchtitan_loom.depth_sampling import depth_key, training_depth
from torchtitan_loom.distributed import comm_plan
from torchtitan_loom.distributed.comm_plan import Collective
from torchtitan_loom.distributed.parallel_dims import ParallelDims
from torchtitan_loom.distributed.utils import DTYPES
from torchtitan_loom.model_cost import ModelCost
from torchtitan_loom.protocols import get_train_spec

_GIB = float(1 << 30)
_MIB = float(1 << 20)
_OVERLAPPED = ("all_gather", "reduce_scatter")
from torchtitan_loom.distributed.choices import LAYOUTS  # noqa: E402,F401  (re-exported)

"""parallelism.layout: the degrees as written, or the fastest layout of rank_layouts (auto)."""


class Estimate(NamedTuple):
    memory: dict[str, float]
    """Per-rank bytes by part (see MEMORY_PARTS); "total" is their sum."""
    collectives: list[Collective]
    flops: float
    """Model FLOPs per step on one rank."""
    recompute_flops: float
    compute_s: float
    overlapped_s: float
    exposed_s: float
    step_s: float
    mfu: float
    """Percent."""


def count(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun in the number it needs (``1 rank``, ``2 ranks``); components' messages.py
    has the same helper for the layers above this one."""
    return f"{n:,} {one if n == 1 else (many or one + 's')}"


def seconds(c: Collective, hw: Any) -> float:
    """Roofline time of all calls of one collective in a step."""
    factor = (c.size - 1) / c.size * (2 if c.kind == "all_reduce" else 1)
    bandwidth = (hw.intra_node_gbps if c.span <= hw.gpus_per_node else hw.inter_node_gbps) * 1e9
    return c.calls * (hw.latency_us * 1e-6 + c.nbytes * factor / bandwidth)


def _model_cost(cfg: Any, model_args: Any, dims: ParallelDims) -> ModelCost:
    cost_fn = get_train_spec(cfg.model.name).cost_fn
    # the callers (dry_run.py, config/validate.py) estimate only a model that has a cost_fn
    assert cost_fn is not None, f"model {cfg.model.name!r} has no TrainSpec.cost_fn"
    return cost_fn(model_args, dims, cfg)


def estimate(cfg: Any, model_args: Any, dims: ParallelDims, cost: Any = None) -> Estimate:
    """The estimate of `cfg` on `dims` (cost: the spec's ModelCost, built when not given)."""
    cost = cost or _model_cost(cfg, model_args, dims)
    t, hw = cfg.training, cfg.estimate
    pb, rb = DTYPES[t.mixed_precision_param].itemsize, DTYPES[t.mixed_precision_reduce].itemsize
    micro = t.global_batch_size // dims.dp // t.micro_batch_size
    loop_ranges, sampler = training_depth(t, model_args.num_loops)
    segs = [cost.segment(a, b) for a, b in loop_ranges]
    if dims.fsdp_enabled:
        gathered = [comm_plan.padded_numel(u, comm_plan.shard_degree(u, dims)) for u in cost.units]
        local = sum(g // comm_plan.shard_degree(u, dims) for g, u in zip(gathered, cost.units))
        local += comm_plan.replicated_numel(cost, dims)
        per_segment_sync = cfg.parallelism.fsdp_sync == "segment"
        # "always" frees a unit after each forward call, but a backward keeps it gathered from its
        # first use to its last (parallelize.LoopedBlockSync), and a deferred sync through the
        # backward: then every unit is gathered at once there too.
        looped = any(c > 1 for seg in segs for c in seg.unit_calls.values())
        keep_all = (
            cfg.parallelism.fsdp_reshard_after_forward != "always"
            or looped
            or (per_segment_sync and micro > 1)
        )
        gathered_bytes = pb * (sum(gathered) if keep_all else 2 * max(gathered))
        # Accumulated in the parameters' own (unpadded) shapes; padding lives in the gather buffers only.
        full = sum(math.prod(shape) for u in cost.units for shape in u.shapes)
        unsharded_grads = rb * full if per_segment_sync else 0
    else:
        local, gathered_bytes, unsharded_grads = cost.total_params, 0, 0
    memory = {
        "parameters (fp32)": 4.0 * local,
        "gradients (fp32)": 4.0 * local,
        # The optimizer table's figures, read through the config (this layer is below components).
        cfg.optimizer.state_label: float(cfg.optimizer.state_bytes_per_param * local),
        "gathered parameters": float(gathered_bytes),
        "unsharded gradient accumulation": float(unsharded_grads),
        f"activations of one micro-batch ({cfg.activation_checkpoint.mode})": float(
            max(s.activation_bytes for s in segs)
        ),
        "logits and their gradient": float(segs[0].logits_bytes),
        f"carries of {count(micro, 'micro-batch', 'micro-batches')}": float(
            micro * segs[0].carry_bytes
        ),
    }
    memory["total"] = sum(memory.values())
    collectives = comm_plan.predict(cfg, cost, dims, model_args.num_loops)
    # Depth sampling: segment j runs on a fraction of the steps (memory and collectives above
    # are the deepest step's, the worst case).
    runs = [1.0] * len(segs) if sampler is None else sampler.segment_weights()
    flops = micro * sum(w * s.flops for w, s in zip(runs, segs))
    recompute = micro * sum(w * s.recompute_flops for w, s in zip(runs, segs))
    compute_s = (flops + recompute) / (hw.peak_tflops * 1e12 * hw.achievable_fraction)
    overlapped = sum(
        seconds(c, hw)
        for c in collectives
        if c.kind in _OVERLAPPED or (c.kind == "all_reduce" and c.group == "dp_replicate")
    )
    exposed = sum(seconds(c, hw) for c in collectives) - overlapped
    step_s = max(compute_s, overlapped) + exposed
    return Estimate(
        memory,
        collectives,
        flops,
        recompute,
        compute_s,
        overlapped,
        exposed,
        step_s,
        100.0 * flops / (step_s * hw.peak_tflops * 1e12),
    )


def assumptions(hw: Any) -> str:
    return (
        f"assumptions (keys under [estimate]): peak {hw.peak_tflops:g} TFLOP/s per GPU × "
        f"{hw.achievable_fraction:g} achievable, {hw.intra_node_gbps:g} GB/s within a node of "
        f"{hw.gpus_per_node} GPUs, {hw.inter_node_gbps:g} GB/s between nodes, {hw.latency_us:g} µs per "
        f"collective, {hw.memory_gib:g} GiB per GPU"
    )


def report(cfg: Any, model_args: Any, dims: ParallelDims) -> list[str]:
    """The estimate's lines for the dry run, then the layouts ranked. Every figure says whether it is
    per rank or for the whole step over all ranks."""
    est = estimate(cfg, model_args, dims)
    t, hw = cfg.training, cfg.estimate
    n_seg = len(training_depth(t, model_args.num_loops)[0])
    micro = t.global_batch_size // dims.dp // t.micro_batch_size
    lines = [
        "estimate per rank (a roofline, not a measurement; a figure for all ranks says so)",
        "  " + assumptions(hw),
        "  memory per rank (GiB):",
    ]
    for part, nbytes in est.memory.items():
        if nbytes or part == "total":
            lines.append(f"    {part:<44} {nbytes / _GIB:8.2f}")
    sync = cfg.parallelism.fsdp_sync
    lines.append(
        f"  communication per step on each rank ({count(n_seg, 'segment')} × "
        f"{count(micro, 'micro-batch', 'micro-batches')}, FSDP "
        f"sync per {sync}):"
    )
    if not est.collectives:
        lines.append("    none (one rank)")
    else:
        lines += _collective_table(est.collectives, hw, n_seg)
        lines += _padding_notes(cfg, model_args, dims)
        if dims.ep_enabled:
            lines.append(
                "    (expert all-to-all: the rows a rank receives follow the routing; their mean is shown)"
            )
    ranges, sampler = training_depth(t, model_args.num_loops)
    if sampler is None and ranges[-1][1] > model_args.num_loops:
        lines.append(f"  depth past H ({depth_key(t)}): every step runs {ranges[-1][1]} loops")
    if sampler is not None:
        lines.append(
            f"  depth sampling ({depth_key(t)}): a step runs "
            f"{sampler.depths()} loops, "
            f"{sampler.mean_loops():.2f} on average; FLOPs and time are the expected ones, memory "
            "and communication the deepest step's"
        )
    lines.append(
        f"  FLOPs per step: {est.flops / 1e12:,.1f} TFLOP model + {est.recompute_flops / 1e12:,.1f} "
        f"TFLOP recompute ({cfg.activation_checkpoint.mode}) on each rank; "
        f"{est.flops * dims.world_size / 1e12:,.1f} TFLOP model over all {count(dims.world_size, 'rank')}"
    )
    if not est.overlapped_s:
        hidden = ""
    elif est.overlapped_s <= est.compute_s:
        hidden = " (hidden behind the compute)"
    else:
        hidden = (
            f" (longer than the compute by {est.overlapped_s - est.compute_s:.2f} s: the step "
            f"waits on them)"
        )
    lines.append(
        f"  step time: compute {est.compute_s:.2f} s, FSDP collectives {est.overlapped_s:.2f} s"
        f"{hidden}, other collectives {est.exposed_s:.2f} s (on the critical path) -> "
        f"{est.step_s:.2f} s per step, MFU {est.mfu:.1f}%, "
        f"{t.global_batch_size * t.seq_len / est.step_s:,.0f} tokens/s over all ranks"
    )
    lines += recommend(cfg, model_args, dims.world_size, current=est)
    return lines


def _collective_table(collectives: list[Collective], hw: Any, n_seg: int) -> list[str]:
    """One row per collective; the repeated units' rows (layers.{l}) are per unit and say × n, and
    the total line sums every unit."""
    lines = [
        f"    {'collective':<15} {'unit / purpose':<36} {'group':<26} {'per segment':>11} "
        f"{'MiB per call':>12} {'GiB per step':>12} {'ms per step':>11}"
    ]
    total_gib = total_ms = 0.0
    repeated = 0
    for c, n in _folded(collectives):
        link = "node" if c.span <= hw.gpus_per_node else "network"
        per_seg = f"{c.calls / n_seg:g}" if c.calls % n_seg == 0 else "-"
        gib, ms = c.calls * c.nbytes / _GIB, seconds(c, hw) * 1e3
        total_gib, total_ms = total_gib + n * gib, total_ms + n * ms
        repeated = max(repeated, n)
        what = f"{c.what} (per unit, × {n})" if n > 1 else c.what
        lines.append(
            f"    {c.kind:<15} {what:<36} {f'{c.group} {c.size} ({link})':<26} {per_seg:>11} "
            f"{c.nbytes / _MIB:12.3f} {gib:12.3f} {ms:11.2f}"
        )
    rows = " (each per-unit row × its count)" if repeated > 1 else ""
    lines.append(
        f"    {'total':<15} {'every unit and purpose' + rows:<64} {'':>11} {'':>12} "
        f"{total_gib:12.3f} {total_ms:11.2f}"
    )
    return lines


def _padding_notes(cfg: Any, model_args: Any, dims: ParallelDims) -> list[str]:
    """Where FSDP's padding grows a unit's gathered size: a split dimension smaller than, or not a
    multiple of, the shard degree (e.g. 30 routed experts over 64 ranks pad to 64 rows)."""
    cost = _model_cost(cfg, model_args, dims)
    notes, seen = [], set()
    for unit in cost.units:
        n = comm_plan.shard_degree(unit, dims)
        real = sum(math.prod(shape) for shape in unit.shapes)
        padded = comm_plan.padded_numel(unit, n)
        if n <= 1 or padded == real:
            continue
        name = re.sub(r"^layers\.\d+", "layers.{l}", unit.name)
        uneven = sorted({s[unit.shard_dim] for s in unit.shapes if s[unit.shard_dim] % n})
        if name in seen:
            continue
        seen.add(name)
        notes.append(
            f"    padding: {name} gathers and reduce-scatters {padded / real:.2f}× its parameters: "
            f"FSDP splits dim {unit.shard_dim} over {n} ranks and rounds a size of "
            f"{', '.join(map(str, uneven))} up to a multiple of {n}"
        )
    return notes


def _folded(collectives: list[Collective]) -> list[tuple[Collective, int]]:
    """Per-layer units folded into one row per kind (layers.{l}), with the number of units folded."""
    rows: dict[tuple, Collective] = {}
    layers: dict[tuple, set] = {}
    for c in comm_plan.merged(collectives):
        match = re.match(r"^layers\.(\d+)(.*)$", c.what)
        what = f"layers.{{l}}{match.group(2)}" if match else c.what
        key = (c.kind, what, c.group, c.nbytes)
        layers.setdefault(key, set()).add(match.group(1) if match else "")
        rows[key] = (
            rows[key]._replace(calls=rows[key].calls + c.calls)
            if key in rows
            else c._replace(what=what)
        )
    out = []
    for key, c in rows.items():
        n = len(layers[key])
        out.append((c._replace(calls=c.calls // n), n))
    return out


def candidate_layouts(
    cfg: Any, model_args: Any, world: int, allowed: Callable[[ParallelDims], bool] | None = None
) -> list[tuple[Any, ParallelDims]]:
    """Every valid (dp_replicate, dp_shard, ep) of `world` ranks for this config, as configs + dims;
    `allowed` filters them further (the config's pinned degrees and rules, see config/validate.py)."""
    # The model's own rules through its TrainSpec, as validate.py asks them.
    spec = get_train_spec(cfg.model.name)
    num_experts = spec.num_experts_fn(model_args) if spec.num_experts_fn is not None else None
    out = []
    for replicate in (r for r in range(1, world + 1) if world % r == 0):
        shard = world // replicate
        for ep in (e for e in range(1, shard + 1) if shard % e == 0 and (e == 1 or shard > 1)):
            candidate = copy.deepcopy(cfg)
            candidate.parallelism.dp_replicate, candidate.parallelism.dp_shard = replicate, shard
            candidate.parallelism.ep = ep
            try:
                dims = ParallelDims.from_config(
                    candidate.parallelism, world, num_experts=num_experts
                )
            except ValueError:  # a degree rule (ParallelDims checks every one, once)
                continue
            if spec.layout_errors_fn is not None and spec.layout_errors_fn(model_args, dims):
                continue
            if allowed is None or allowed(dims):
                out.append((candidate, dims))
    return out


class Ranked(NamedTuple):
    dims: ParallelDims
    estimate: Estimate
    fits: bool
    """Its estimated memory per rank is within estimate.memory_gib."""


def rank_layouts(
    cfg: Any, model_args: Any, world: int, allowed: Callable[[ParallelDims], bool] | None = None
) -> list[Ranked]:
    """The candidate layouts, those that fit first, fastest first; equal times (compute-bound):
    the one with less memory per rank first."""
    ranked = []
    for candidate, dims in candidate_layouts(cfg, model_args, world, allowed):
        est = estimate(candidate, model_args, dims)
        ranked.append(Ranked(dims, est, est.memory["total"] <= cfg.estimate.memory_gib * _GIB))
    ranked.sort(key=lambda r: (not r.fits, round(r.estimate.step_s, 3), r.estimate.memory["total"]))
    return ranked


def layout_name(dims: ParallelDims) -> str:
    return f"dp_replicate {dims.dp_replicate} × dp_shard {dims.dp_shard}, ep {dims.ep}"


def choice_line(ranked: list[Ranked]) -> str:
    """The auto layout's one log line: the choice and the runner-up, with their estimates."""

    def one(r: Ranked) -> str:
        fit = "" if r.fits else ", does not fit in estimate.memory_gib"
        return (
            f"{layout_name(r.dims)} (estimated {r.estimate.step_s:.2f} s per step, "
            f"MFU {r.estimate.mfu:.1f}%{fit})"
        )

    runner_up = f"; runner-up {one(ranked[1])}" if len(ranked) > 1 else "; the only valid layout"
    return f"layout auto: {one(ranked[0])}{runner_up}"


def recommend(cfg: Any, model_args: Any, world: int, current: Estimate | None = None) -> list[str]:
    """The three fastest layouts of `world` ranks that fit in estimate.memory_gib, by estimated step time."""
    if world == 1:
        return []
    ranked = rank_layouts(cfg, model_args, world)
    if not ranked:
        return []
    lines = [
        f"  layouts of {world} ranks, fastest first (this batch geometry and activation_checkpoint "
        f"mode; step times and MFU of the whole step, memory per rank):"
    ]
    for r in ranked[:3]:
        lines.append(
            f"    {layout_name(r.dims)}: {r.estimate.step_s:.2f} s per step, "
            f"MFU {r.estimate.mfu:.1f}%, {r.estimate.memory['total'] / _GIB:.1f} GiB per rank"
            + ("" if r.fits else "  (does not fit in estimate.memory_gib)")
        )
    best = ranked[0].dims
    lines.append(
        f"  recommended: --parallelism.dp_replicate {best.dp_replicate} --parallelism.dp_shard "
        f"{best.dp_shard} --parallelism.ep {best.ep}, or --parallelism.layout auto"
        + (
            ""
            if ranked[0].fits
            else "  (nothing fits: use activation checkpointing or a smaller micro-batch)"
        )
    )
    if current is not None and not math.isclose(current.step_s, ranked[0].estimate.step_s):
        lines.append(f"  (this config's layout: {current.step_s:.2f} s per step)")
    return lines
