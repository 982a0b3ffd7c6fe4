"""How many loops does a token need: a depth report for any checkpoint.

    python -m torchtitan_loom.tools.depth CKPT [--data PACK] [--tokens N] [--capacity off]
        [--max-loops N] [--beyond last,cycle] [--kl T,T,..] [--confidence T,T,..] [--learned T,..]
        [--adaptive-max N] [--out DIR]

Held-out loss (and the run's downstream task scores, ``--tasks``) after each of loops 1..2H (past the trained H the routers follow each --beyond
policy: ``last`` reuses router H, ``cycle`` runs routers 1..H again), and per-token adaptive exit
swept over thresholds of each criterion (components/evaluation/adaptive_exit.py): the curve of loss
against mean loops per token and forward FLOPs per token, with the fixed-depth points on the same
axes; each adaptive point is set against the fixed-depth curve at its mean loops and FLOPs, and
the verdict credits an exit only with the loops it saves beyond the fewest fixed loops within 1%
of the best fixed-depth loss (tools/depth_verdict.py). By default it reads and runs what the run's
held-out eval does (tools/depth_settings.py: the loss after H loops is the logged eval_loss), and
names every setting that differs from it. A table on the console and in ``depth.md``, the
numbers in ``depth.json``, the figure in ``depth.png``, by default under
``<run folder>/depth/step-<N>/`` (never the current directory; an occupied folder needs --force,
and only those three files are replaced). CKPT and the held-out data as for tools.analyze.
Progress lines on stdout. Bad input: one line, exit code 2.
This module is the command line (no torch before its first line); tools/depth_run.py measures,
tools/depth_report.py writes.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.runtime.messages import shorten_line
from torchtitan_loom.tools.depth_settings import CAPACITY
from torchtitan_loom.tools.progress import Progress

# The default sweeps: thresholds spaced to span "exits nothing" to "exits most tokens" on the
# debug runs of docs/studying_depth.md.
KL_THRESHOLDS = "0.001,0.003,0.01,0.03,0.1,0.3,1"
CONFIDENCE_THRESHOLDS = "0.001,0.01,0.05,0.1,0.2,0.3,0.5,0.7,0.9"
LEARNED_THRESHOLDS = "0.001,0.003,0.01,0.02,0.03,0.05,0.1"


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated numbers") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_loom.tools.depth", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("ckpt", help="checkpoint directory (step-N), checkpoint folder or run folder")
    p.add_argument("--data", default=None, help="pack whose holdout is read (default: the run's)")
    p.add_argument(
        "--tokens", type=int, default=None, help="held-out tokens (default: the run's eval.tokens)"
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="row length (default: training.seq_len)"
    )
    p.add_argument(
        "--batch-rows",
        type=int,
        default=None,
        help="rows per forward (default: training.micro_batch_size, as the eval runs them)",
    )
    p.add_argument(
        "--capacity",
        choices=CAPACITY,
        default="trained",
        help="MoE capacity dropping: as trained, which the eval measured (default), or off, as "
        "generate and lm_eval run",
    )
    p.add_argument("--max-loops", type=int, default=None, help="deepest fixed depth (default 2H)")
    p.add_argument(
        "--beyond", default="last,cycle", help="policies past H to measure (default last,cycle)"
    )
    p.add_argument("--kl", default=KL_THRESHOLDS, help=f"KL thresholds (default {KL_THRESHOLDS})")
    p.add_argument(
        "--confidence",
        default=CONFIDENCE_THRESHOLDS,
        help=f"1 - top-probability thresholds (default {CONFIDENCE_THRESHOLDS})",
    )
    p.add_argument(
        "--learned",
        default=None,
        help="thresholds of the exit head's predicted loss drop of the next loops, in nats "
        "(model.exit_head; asked at the run's backprop segment ends; default "
        f"{LEARNED_THRESHOLDS} on a checkpoint with the head, none without)",
    )
    p.add_argument(
        "--adaptive-max", type=int, default=None, help="deepest adaptive loop (default H)"
    )
    p.add_argument(
        "--tasks",
        default=None,
        help="lm-eval tasks scored after each loop, comma-separated (default: the run's "
        "eval.downstream_tasks when it scored any; none: skip)",
    )
    p.add_argument("--tasks-dir", default=None, help="extra folder of lm-eval task YAML files")
    p.add_argument("--only-tasks-dir", action="store_true", help="index only --tasks-dir (faster)")
    p.add_argument("--limit", type=int, default=None, help="at most N documents per task")
    p.add_argument("--out", default=None, help="output folder (default <run>/depth/step-<N>)")
    p.add_argument("--force", action="store_true", help="replace an earlier report in --out")
    return p


def plan_maker(ns: argparse.Namespace):
    """ns -> (H -> DepthPlan), every range checked (ValueError: one line)."""
    from torchtitan_loom.components.evaluation.adaptive_exit import threshold_problem
    from torchtitan_loom.protocols import BEYOND_POLICIES
    from torchtitan_loom.tools.depth_run import DepthPlan

    policies = tuple(x.strip() for x in ns.beyond.split(",") if x.strip())
    for policy in policies or ("",):
        if policy not in BEYOND_POLICIES:
            raise ValueError(f"--beyond {ns.beyond!r}: valid {', '.join(BEYOND_POLICIES)}")
    thresholds = {
        "kl": _floats(ns.kl, "--kl"),
        "confidence": _floats(ns.confidence, "--confidence"),
        "learned": _floats(ns.learned or LEARNED_THRESHOLDS, "--learned"),
    }
    for criterion, values in thresholds.items():
        for value in values:
            problem = threshold_problem(criterion, value)
            if problem:
                raise ValueError(f"--{criterion}: {problem}")
    if ns.limit is not None and ns.limit < 1:
        raise ValueError(f"--limit {ns.limit}: must be ≥ 1")
    if ns.tasks == "none" and (ns.tasks_dir or ns.only_tasks_dir or ns.limit is not None):
        raise ValueError(
            "--tasks none scores no task: leave out --tasks-dir, --only-tasks-dir, --limit"
        )
    for key in ("tokens", "batch_rows", "seq_len"):
        if getattr(ns, key) is not None and getattr(ns, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} {getattr(ns, key)}: must be ≥ 1")

    def plan(H: int) -> DepthPlan:
        max_loops = 2 * H if ns.max_loops is None else ns.max_loops
        adaptive_max = H if ns.adaptive_max is None else ns.adaptive_max
        if not H <= max_loops <= 4 * H:
            raise ValueError(f"--max-loops {max_loops}: valid {H}..{4 * H} (H={H})")
        if not 1 <= adaptive_max <= max_loops:
            raise ValueError(f"--adaptive-max {adaptive_max}: valid 1..{max_loops}")
        return DepthPlan(max_loops, policies, adaptive_max, thresholds, ns.learned is not None)

    return plan


def tasks_maker(ns: argparse.Namespace):
    """ns -> (the run's config or None -> the [eval] section whose tasks are scored, or None)."""
    import dataclasses

    def tasks(run_cfg: Any) -> Any:
        from torchtitan_loom.config.sections_train import Eval

        base = run_cfg.eval if run_cfg is not None else Eval()
        if ns.tasks == "none":
            return None
        names = [t.strip() for t in ns.tasks.split(",") if t.strip()] if ns.tasks else []
        if not names and base.downstream_interval:  # the run scored these during training
            names = list(base.downstream_tasks)
        if not names:
            return None
        return dataclasses.replace(
            base,
            downstream_tasks=names,
            downstream_tasks_dir=ns.tasks_dir or base.downstream_tasks_dir,
            downstream_only_tasks_dir=ns.only_tasks_dir or base.downstream_only_tasks_dir,
            downstream_limit=base.downstream_limit if ns.limit is None else ns.limit,
        )

    return tasks


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    progress = Progress("depth")
    print(f"depth: loading {ns.ckpt} ...", flush=True)
    import torch

    from torchtitan_loom.tools.depth_report import tables
    from torchtitan_loom.tools.depth_run import DepthError, run_depth

    try:
        plan_of = plan_maker(ns)

        def checked_plan(H: int):
            try:
                return plan_of(H)
            except ValueError as exc:
                raise DepthError(str(exc)) from None

        with torch.no_grad():
            flags = {
                k: getattr(ns, k) for k in ("data", "tokens", "seq_len", "batch_rows", "capacity")
            }
            path, numbers = run_depth(
                ns.ckpt,
                flags,
                ns.out,
                ns.force,
                checked_plan,
                progress,
                tasks_maker(ns),
            )
    except (DepthError, ValueError) as exc:
        print(shorten_line(f"depth error: {exc}"), file=sys.stderr)
        return exit_codes.BAD_INPUT
    print(tables(numbers))
    print(f"report written: {path}")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
