"""The writing half of tools.depth: the numbers of tools/depth_run.measure turned into the report
(``depth.json``), its tables (console and ``depth.md``) and one figure (``depth.png``: held-out
loss against loops per token and against forward FLOPs per token, fixed depth and adaptive exit
on the same axes, so the saving at equal loss is read off directly).

Every adaptive point is set against the fixed-depth curve at its mean loops and at its FLOPs, and
the verdict credits an exit only with the loops it saves beyond the fewest fixed loops within 1% of
the best fixed-depth loss (tools/depth_verdict.py says how).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from torchtitan_loom.tools import out_files
from torchtitan_loom.tools.depth_verdict import WITHIN, against_curve, baseline, verdict


def report(sums: dict[str, Any], plan: Any, flops: Any, loaded: Any, reads: Any) -> dict[str, Any]:
    """depth.json's payload from measure()'s sums; ``reads`` is depth_settings.Reads."""
    n = sums["tokens"]
    H = loaded.model.num_loops
    fixed = {
        policy: [
            {"loops": t + 1, "loss": ce / n, "gflops_per_token": flops.fixed(t + 1) / 1e9}
            for t, ce in enumerate(ces)
        ]
        for policy, ces in sums["ce"].items()
    }
    adaptive = [
        {
            "criterion": s.criterion,
            "threshold": s.threshold,
            "loss": s.ce_sum / s.tokens,
            "mean_loops": s.loops_sum / s.tokens,
            "gflops_per_token": flops.adaptive(s.loops_sum / s.tokens) / 1e9,
            "exits_after_loop": s.exits,
        }
        for s in sums["sweeps"]
    ]
    curve = fixed[plan.policies[0]]  # the policy adaptive loops past H run under
    base = baseline(curve, H)
    adaptive = [{**a, **against_curve(a, curve, base)} for a in adaptive]
    deeper = {
        p: sum(r["loss"] for r in rows[H:]) / max(len(rows) - H, 1) for p, rows in fixed.items()
    }
    better = min(deeper, key=lambda p: deeper[p]) if plan.max_loops > H else None
    return {
        "checkpoint": loaded.checkpoint,
        "step": loaded.step,
        "trained_loops": H,
        "data": reads.val_path or reads.data,
        "seq_len": reads.seq_len,
        "tokens": n,
        "reads": dataclasses.asdict(reads),
        "reads_text": reads.describe(),
        "adaptive_max_loops": plan.adaptive_max,
        "fixed": fixed,
        "better_beyond": better,
        "adaptive": adaptive,
        "verdict": verdict(curve, H, adaptive),
    }


def tables(numbers: dict[str, Any]) -> str:
    """The two markdown tables and the verdict (the console shows the same text)."""
    fixed = numbers["fixed"]
    policies = list(fixed)
    H = numbers["trained_loops"]
    lines = [
        "| loops | " + " | ".join(f"loss ({p})" for p in policies) + " | GFLOP/token |",
        "|---:|" + "---:|" * len(policies) + "---:|",
    ]
    for i, row in enumerate(fixed[policies[0]]):
        mark = " (H)" if row["loops"] == H else ""
        losses = " | ".join(f"{fixed[p][i]['loss']:.4f}" for p in policies)
        lines.append(f"| {row['loops']}{mark} | {losses} | {row['gflops_per_token']:.4f} |")
    d = numbers["verdict"]["depth"]
    lines += [
        "",
        "| exit | threshold | mean loops | loss | vs fixed curve, same loops | "
        f"vs fixed curve, same FLOPs | loops saved vs depth {d} | fixed loops, same loss | "
        "GFLOP/token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in numbers["adaptive"]:
        lines.append(
            f"| {a['criterion']} | {a['threshold']:g} | {a['mean_loops']:.2f} | {a['loss']:.4f} | "
            f"{_vs(a['loss'], a['curve_loss_at_loops'])} | "
            f"{_vs(a['loss'], a['curve_loss_at_flops'])} | "
            f"{a['loops_saved']:.2f} | {_same_loss(a)} | {a['gflops_per_token']:.4f} |"
        )
    lines += _task_table(numbers.get("task_scores"), H)
    better = numbers["better_beyond"]
    lines.append("")
    if better is not None:
        lines.append(f"Loops past H: the {better} policy gives the lower loss here.")
    lines.append(f"{numbers['reads_text']}.")
    lines.append(f"Verdict: {numbers['verdict']['text']}.")
    return "\n".join(lines)


def _same_loss(a: dict[str, Any]) -> str:
    """The fixed loops of the point's loss and the share it saves: "2.84 (25% fewer)"."""
    equal, fewer = a.get("fixed_loops_same_loss"), a.get("fewer_loops_same_loss")
    if equal is None or fewer is None:
        return "— (worse than 1 loop)"
    share = round(fewer, 2) + 0.0  # no "-0%"
    return f"{equal:.2f} ({abs(share):.0%} {'fewer' if share >= 0 else 'more'})"


def _vs(loss: float, curve: float | None) -> str:
    """A point's loss against the fixed curve's there: + above it (worse), - below; — past it."""
    return "—" if curve is None else f"{round(loss / curve - 1, 4) + 0.0:+.2%}"  # no "-0.00%"


def _task_table(tasks: dict[str, Any] | None, H: int) -> list[str]:
    """The downstream scores after each loop (depth_run.task_scores), or nothing."""
    if not tasks:
        return []
    keys = sorted({k for row in tasks["by_loops"] for k in row["scores"]})
    lines = [
        "",
        f"| loops (past H: {tasks['policy']}) | "
        + " | ".join(k.removeprefix("downstream/") for k in keys)
        + " |",
        "|---:|" + "---:|" * len(keys),
    ]
    for row in tasks["by_loops"]:
        mark = " (H)" if row["loops"] == H else ""
        cells = [f"{row['scores'][k]:.4f}" if k in row["scores"] else "—" for k in keys]
        lines.append(f"| {row['loops']}{mark} | " + " | ".join(cells) + " |")
    return lines


def write_report(numbers: dict[str, Any], out: str) -> str:
    """depth.json, depth.png and depth.md in ``out``; returns depth.md's path."""
    out_files.write_file(
        os.path.join(out, "depth.json"), json.dumps(numbers, indent=1) + "\n", owner=out
    )
    _figure(numbers, os.path.join(out, "depth.png"), out)
    md = [
        f"# Depth report: step {numbers['step']}",
        "",
        f"Checkpoint `{numbers['checkpoint']}` (trained with H = {numbers['trained_loops']} loops); "
        f"held-out loss over {numbers['tokens']:,} tokens of `{numbers['data']}` in rows of "
        f"{numbers['seq_len']} (the settings line below the tables says where they differ from "
        "the run's own held-out eval). Past H the routers follow a policy: `last` reuses router "
        "H, `cycle` runs routers 1..H again. Adaptive exit stops each token after the first loop "
        "where its criterion is below the threshold (kl: KL between successive loops' "
        "predictions; confidence: 1 - top probability; learned: the trained exit head's "
        "predicted loss drop of the next loops, asked at the run's backprop segment ends), up to "
        f"{numbers['adaptive_max_loops']} loops; an exited token's keys and values in deeper "
        "loops are its exit loop's. Forward FLOPs per token count the head once per prediction "
        "read (an adaptive token reads one after every loop it runs). Each adaptive point is "
        "set against the fixed-depth curve (straight lines between the fixed depths) at its mean "
        "loops and at its FLOPs: + above it (worse than fixed depths), - below. An exit is "
        "credited only with the loops it saves beyond the fewest fixed loops whose loss is within "
        f"{WITHIN:.0%} of the best fixed-depth loss at depths 1..H, and only when it is within "
        f"{WITHIN:.0%} itself and below the curve. The fixed loops of the same loss are what "
        "the falling part of the fixed-depth curve (depths 1 up to the best) needs for the "
        "point's loss (the best depth when the point is at or below every fixed depth), and the "
        "share of them the point does not run.",
        "",
        tables(numbers),
        "",
        "![loss against loops and FLOPs per token](depth.png)",
        "",
    ]
    path = os.path.join(out, "depth.md")
    out_files.write_file(path, "\n".join(md), owner=out)
    return path


def _figure(numbers: dict[str, Any], path: str, owner: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    H = numbers["trained_loops"]
    for ax, x_key, label in (
        (axes[0], "loops", "loops per token (mean)"),
        (axes[1], "gflops_per_token", "forward GFLOP per token"),
    ):
        for policy, rows in numbers["fixed"].items():
            ax.plot(
                [r[x_key] for r in rows],
                [r["loss"] for r in rows],
                "o-" if policy == numbers["better_beyond"] else "s--",
                label=f"fixed depth (past H: {policy})",
                alpha=0.8,
            )
        for criterion in sorted({a["criterion"] for a in numbers["adaptive"]}):
            pts = sorted(
                (a for a in numbers["adaptive"] if a["criterion"] == criterion),
                key=lambda a: a["mean_loops"],
            )
            xs = [a["mean_loops"] if x_key == "loops" else a[x_key] for a in pts]
            ax.plot(xs, [a["loss"] for a in pts], "^-", label=f"adaptive exit ({criterion})")
        v = numbers["verdict"]
        ax.axhline(
            v["target_loss"],
            color="grey",
            linestyle="--",
            linewidth=0.8,
            label=f"within {v['within']:.0%} of the best fixed depth (fewest loops: {v['depth']})",
        )
        if x_key == "loops":
            ax.axvline(H, color="grey", linestyle=":", label=f"trained H = {H}")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out loss (nats per token)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Loss against depth, step {numbers['step']} ({numbers['tokens']:,} tokens)")
    fig.tight_layout()
    out_files.write_figure(fig, path, owner, dpi=110)
    plt.close(fig)
