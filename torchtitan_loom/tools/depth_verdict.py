"""The depth report's verdict (tools/depth_report.py writes it): every adaptive point against the
fixed-depth curve, and the fixed depth an exit has to beat. Torch-free; the numbers in, the
numbers and a sentence out.

The fixed-depth curve joins the losses after 1, 2, ... loops with straight lines: between depths t
and t + 1, at a mean of m loops per token, it is what running a random share m - t of the tokens
one loop deeper gives, with no criterion at all. An adaptive point on that line does no better
than fixed depths. The same curve on the forward-FLOPs axis compares a point at equal compute
(an adaptive token reads the head after every loop, so it costs more than its mean loops).

The baseline: the best fixed-depth loss over depths 1 .. H (what a user gets without any exit,
by choosing the depth), and the fewest loops whose loss is within WITHIN of it (the "named"
depth d: on the README's run, loops 1 / 2 / 3 give 0.8672 / 0.8310 / 0.8287, so d = 2). An
adaptive point with mean loops m is credited with d - m loops when its loss is within WITHIN of
the best fixed-depth loss, it lies below the curve at m, and m < d; otherwise with nothing. The
verdict names the point with the most credit, or says that no point beats the curve.
"""

from __future__ import annotations

import json
import os
from typing import Any

WITHIN = 0.01  # the verdict's loss margin over the best fixed-depth loss at depths 1..H
ROUNDING = 1e-6  # "below the curve" means by more than this relative margin (float rounding)


def curve_at(xs: list[float], ys: list[float], x: float) -> float | None:
    """The piecewise-linear curve through (xs, ys) (xs increasing) at x; None outside xs' range."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[0]  # a one-point curve at x == xs[0]


def baseline(fixed: list[dict[str, Any]], H: int) -> dict[str, Any]:
    """The best fixed-depth loss over depths 1..H, the tolerance, and the fewest loops within it."""
    rows = fixed[:H]
    best = min(rows, key=lambda r: r["loss"])
    target = best["loss"] * (1 + WITHIN)
    named = next(r for r in rows if r["loss"] <= target)  # best itself qualifies
    return {
        "within": WITHIN,
        "best_depth": best["loops"],
        "best_loss": best["loss"],
        "target_loss": target,
        "depth": named["loops"],
        "depth_loss": named["loss"],
        "depth_gflops_per_token": named["gflops_per_token"],
    }


def loops_for_loss(fixed: list[dict[str, Any]], best_depth: int, loss: float) -> float | None:
    """The fewest mean loops the fixed-depth curve needs for ``loss`` (its falling part, depths
    1 .. best_depth: past the best depth more loops give no lower loss); best_depth when ``loss``
    is at or below the best fixed-depth loss, None when it is above depth 1's."""
    rows = fixed[:best_depth]
    if loss > rows[0]["loss"]:
        return None
    for a, b in zip(rows, rows[1:]):
        if loss >= b["loss"]:
            if a["loss"] == b["loss"]:
                return float(a["loops"])
            return a["loops"] + (a["loss"] - loss) / (a["loss"] - b["loss"])
    return float(rows[-1]["loops"]) if len(rows) > 1 else 1.0


def against_curve(
    point: dict[str, Any], fixed: list[dict[str, Any]], base: dict[str, Any]
) -> dict[str, Any]:
    """The point's place against the fixed curve: the curve's loss at its mean loops and at its
    FLOPs (None past the deepest fixed point), the loops it is credited with, and the fixed loops
    of equal loss (loops_for_loss) with the share of them the point does not run (issue 46's
    goal: 25%; negative when it runs more)."""
    losses = [r["loss"] for r in fixed]
    at_loops = curve_at([float(r["loops"]) for r in fixed], losses, point["mean_loops"])
    at_flops = curve_at([r["gflops_per_token"] for r in fixed], losses, point["gflops_per_token"])
    below = at_loops is not None and point["loss"] < at_loops * (1 - ROUNDING)
    credited = (
        below and point["loss"] <= base["target_loss"] and point["mean_loops"] < base["depth"]
    )
    equal = loops_for_loss(fixed, base["best_depth"], point["loss"])
    return {
        "curve_loss_at_loops": at_loops,
        "curve_loss_at_flops": at_flops,
        "below_curve": below,
        "loops_saved": base["depth"] - point["mean_loops"] if credited else 0.0,
        "fixed_loops_same_loss": equal,
        "fewer_loops_same_loss": None if equal is None else 1 - point["mean_loops"] / equal,
    }


def verdict(fixed: list[dict[str, Any]], H: int, adaptive: list[dict[str, Any]]) -> dict[str, Any]:
    """The baseline, the credited point with the most loops saved (or None), and a sentence.
    ``adaptive`` points must carry against_curve's keys."""
    base = baseline(fixed, H)
    d, within = base["depth"], f"{WITHIN:.0%}"
    named = f"fixed depth {d} (loss {base['depth_loss']:.4f}) is " + (
        f"the best of depths 1..{H}"
        if base["best_depth"] == d
        else f"within {within} of the best fixed-depth loss {base['best_loss']:.4f} "
        f"(depth {base['best_depth']})"
    )
    credited = [a for a in adaptive if a["loops_saved"] > 0]
    best = max(credited, key=lambda a: a["loops_saved"]) if credited else None
    if best is None:
        text = (
            f"no adaptive point beats the fixed-depth curve: {named}, and no adaptive point within "
            f"{within} of that best loss runs fewer than {d} loops per token below the curve"
        )
        near = [a for a in adaptive if a["loss"] <= base["target_loss"]]
        cheapest = min(near, key=lambda a: a["mean_loops"], default=None)
        if cheapest is not None:
            text += (
                f" (the cheapest within {within}: {cheapest['criterion']} < "
                f"{cheapest['threshold']:g}, {cheapest['mean_loops']:.2f} loops, loss "
                f"{cheapest['loss']:.4f})"
            )
    else:
        flops = 1 - best["gflops_per_token"] / base["depth_gflops_per_token"]
        text = (
            f"{best['criterion']} exit below {best['threshold']:g}: {best['mean_loops']:.2f} loops "
            f"per token, {best['loops_saved']:.2f} fewer than fixed depth {d} "
            f"({best['loops_saved'] / d:.0%}; forward FLOPs per token {abs(flops):.0%} "
            f"{'fewer' if flops >= 0 else 'more'}) at loss {best['loss']:.4f}, "
            f"{1 - best['loss'] / best['curve_loss_at_loops']:.2%} below the fixed-depth curve; "
            f"{named}"
        )
    return {**base, "best": best, "text": text}


def decoding_summary(
    mean: float, loops: int, criterion: str, threshold: float, tokens: int, saved: dict | None
) -> str:
    """generate's line after adaptive decoding: the mean loops, and what they are measured
    against. ``saved`` is saved_report's (path, numbers) or None."""
    line = (
        f"generate: {mean:.2f} loops per token on average (at most {loops}; {criterion} exit "
        f"below {threshold:g}; {tokens} tokens after the prompt); "
    )
    if saved is None:
        return line + (
            "fewer loops than H are no saving by themselves: the depth report (python -m "
            "torchtitan_loom.tools.depth CKPT) sets exits against the fixed-depth curve"
        )
    path, v = saved["path"], saved["verdict"]
    d = v["depth"]
    named = f"fixed depth {d}, within {v['within']:.0%} of the best fixed-depth loss ({path})"
    if mean >= d:
        return line + f"no fewer than {named}"
    return line + (
        f"{d - mean:.2f} fewer than {named}; whether the loss holds at this threshold is that "
        "report's verdict"
    )


def saved_report(folder: str) -> dict | None:
    """{"path", "verdict"} of the depth report in ``folder`` (depth.json), or None when there is
    none or it predates the named depth."""
    path = os.path.join(folder, "depth.json")
    try:
        with open(path, encoding="utf-8") as f:
            v = json.load(f).get("verdict", {})
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(v, dict) or not isinstance(v.get("depth"), int) or "within" not in v:
        return None
    return {"path": path, "verdict": v}
