"""Score a trained LOOM checkpoint with lm-eval (zero-shot benchmarks), after a holdout check.

    python -m torchtitan_loom.tools.lm_eval CKPT --tasks arc_easy,hellaswag [--limit N --batch-size B
        --loops H' --param-dtype fp32|bf16 --holdout-check on|off|record --holdout-threshold 0.005
        --tasks-dir DIR --only-tasks-dir --device cpu|cuda
        --exit kl|confidence|learned --exit-threshold X]
    torchrun --nproc_per_node 4 -m torchtitan_loom.tools.lm_eval CKPT --tasks ...   # requests split over ranks

Before scoring, the checkpoint's held-out loss is recomputed and compared with the eval_loss its
run logged at that step (tools/holdout.py); ``on`` refuses to score on a gap above the threshold.
Scoring runs with capacity dropping off and fp32 parameters by default, so a question's score does
not depend on its batch. ``--exit`` scores every token at its own exit loop (the criteria of
components/evaluation/adaptive_exit.py, ``--loops`` the deepest; the learned head asked at the run's
segment ends), and results.json records the mean loops of the scored tokens. Results go to ``<CKPT>/eval_results/<timestamp>/results.json`` (metrics,
per-sample scores, step, commit, config, holdout) and ``summary.md``, never through a link below
CKPT (or ``--out``; tools/out_files.py). Needs ``pip install
torchtitan_loom[eval]``. Bad input: one line, exit code 2.

Progress on stdout (rank 0): a line before each slow phase (loading, indexing the tasks, the
holdout check, scoring) and, inside the holdout check and scoring, one after the first batch and
then one every ~10 s (tools/progress.py). A damaged line of the run's metrics.jsonl is skipped with
one warning line naming the file and the line (tools/input_files.py); if it held the logged
eval_loss of the step, ``--holdout-check on`` then refuses with "no eval_loss logged".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import subprocess
import sys
import time
from typing import Any

import torch

from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.runtime.messages import count, shorten_line
from torchtitan_loom.distributed.utils import SHORT_DTYPES
from torchtitan_loom.protocols import cast_model_for_inference, get_train_spec
from torchtitan_loom.tools import out_files
from torchtitan_loom.tools.exit_option import check_exit_flags, exit_rule
from torchtitan_loom.tools.holdout import MODES, check
from torchtitan_loom.tools.input_files import BEYOND_HELP
from torchtitan_loom.tools.loading import LoadError, check_loops, load
from torchtitan_loom.tools.progress import Progress

DEFAULT_THRESHOLD = 0.005
# A tqdm progress bar as it is drawn ("  40%|████      | 4/10 [00:01<00:01, 3.9it/s]").
_PROGRESS_BAR = re.compile(r"\d+%\|")
# lm-eval's hint for its own command line, logged for every task whose data comes from a function.
_CLI_HINT = "Custom kwargs can be passed to `--metadata`"


class _DropCliHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _CLI_HINT not in record.getMessage()


@contextlib.contextmanager
def quiet_scoring():
    """lm-eval's per-task tqdm bars (drawn on sys.stderr) and its ``--metadata`` hint (meant for
    lm-eval's own CLI; the bundled tasks build their data with a function) are dropped; any other
    text written to stderr meanwhile is passed on once scoring ends."""
    task_logger, hint = logging.getLogger("lm_eval.api.task"), _DropCliHint()
    task_logger.addFilter(hint)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        task_logger.removeFilter(hint)
        rest = [
            line
            for line in re.split(r"[\r\n]", captured.getvalue())
            if line.strip() and not _PROGRESS_BAR.search(line)
        ]
        if rest:
            print("\n".join(rest), file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_loom.tools.lm_eval", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("ckpt", help="run folder, step-N checkpoint directory or export folder")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--limit", type=int, default=None, help="at most N documents per task")
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="sequences per forward (scores do not depend on it)",
    )
    p.add_argument(
        "--loops",
        type=int,
        default=None,
        help="score after loop H' (1..2H; past H see --beyond); default H",
    )
    p.add_argument(
        "--beyond",
        default=None,
        help=BEYOND_HELP,
    )
    p.add_argument(
        "--param-dtype",
        default="fp32",
        choices=tuple(SHORT_DTYPES),
        help="parameter dtype while scoring",
    )
    p.add_argument(
        "--holdout-check",
        default="on",
        choices=MODES,
        help="compare the recomputed held-out loss "
        "with the logged one: on = refuse on a gap, record = only record it, off = skip",
    )
    p.add_argument(
        "--holdout-threshold", type=float, default=DEFAULT_THRESHOLD, help="largest allowed gap"
    )
    p.add_argument("--tasks-dir", default=None, help="extra directory of lm-eval task YAML files")
    p.add_argument(
        "--only-tasks-dir",
        action="store_true",
        help="index only --tasks-dir (skips lm-eval's own "
        "~15k task configs, which take ~30 s to index)",
    )
    p.add_argument(
        "--exit",
        default=None,
        help="per-token exit: kl, confidence or learned (as generate --exit); default: every "
        "token runs --loops",
    )
    p.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="exit once the criterion is below this (kl and learned ≥ 0, confidence in [0, 1])",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model runs")
    p.add_argument(
        "--tokenizer", default=None, help="override the pack's tokenizer (must match it)"
    )
    p.add_argument("--out", default=None, help="results root; default <CKPT>/eval_results")
    return p


def _commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _task_manager(ns: argparse.Namespace, tasks: list[str]):
    from torchtitan_loom.components.evaluation.downstream import task_manager, unknown_tasks

    if ns.tasks_dir is not None and not os.path.isdir(ns.tasks_dir):
        raise LoadError(f"--tasks-dir {ns.tasks_dir}: not a directory")
    if ns.only_tasks_dir and ns.tasks_dir is None:
        raise LoadError("--only-tasks-dir needs --tasks-dir")
    tm = task_manager(ns.tasks_dir, ns.only_tasks_dir)
    unknown = unknown_tasks(tasks, ns.tasks_dir, ns.only_tasks_dir, manager=tm)
    if unknown:
        raise LoadError(f"--tasks: {unknown[0]}")
    return tm


def summary_table(results: dict[str, Any]) -> str:
    """Markdown table: task, metric, value, stderr."""
    lines = ["| task | metric | value | stderr |", "|---|---|---|---|"]
    for task, metrics in sorted(results.items()):
        for key, value in sorted(metrics.items()):
            if (
                not isinstance(value, (int, float))
                or "_stderr" in key
                or key in ("alias", "sample_len")
            ):
                continue
            metric = key.split(",")[0]
            err = metrics.get(key.replace(metric, metric + "_stderr", 1))
            err_s = f"{err:.4f}" if isinstance(err, (int, float)) else "-"
            lines.append(f"| {task} | {metric} | {value:.4f} | {err_s} |")
    return "\n".join(lines)


def _samples(samples: dict[str, list[dict]] | None) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for task, rows in (samples or {}).items():
        out[task] = [
            {
                "doc_id": r["doc_id"],
                "target": r["target"],
                "resps": [
                    [list(x) if isinstance(x, tuple) else x for x in resp]
                    for resp in r["filtered_resps"]
                ]
                if r["filtered_resps"] and isinstance(r["filtered_resps"][0], (list, tuple))
                else r["filtered_resps"],
                **{m: r[m] for m in r.get("metrics", []) if m in r},
            }
            for r in rows
        ]
    return out


def write_results(root: str, owner: str, payload: dict[str, Any]) -> str:
    """results.json and summary.md in a new ``<root>/<timestamp>``; ``owner`` is the folder the
    user named (``--out``, else the checkpoint): nothing below it is written through a link."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = os.path.join(root, stamp)
    n = 1
    while os.path.lexists(out):
        n += 1
        out = os.path.join(root, f"{stamp}-{n}")
    out_files.make_out(out, LoadError, owner)
    text = json.dumps(payload, indent=2, default=str) + "\n"
    out_files.write_file(os.path.join(out, "results.json"), text, owner=out)
    head = f"# lm-eval of {payload['checkpoint']} (step {payload['step']})\n\n"
    table = summary_table(payload["results"])
    out_files.write_file(os.path.join(out, "summary.md"), f"{head}{table}\n", owner=out)
    return out


def _checked_tasks(ns: argparse.Namespace) -> list[str]:
    """The arguments checked before anything is loaded; the task names (LoadError: one line)."""
    if ns.batch_size < 1:
        raise LoadError(f"--batch-size {ns.batch_size}: must be >= 1")
    if ns.limit is not None and ns.limit < 1:
        raise LoadError(f"--limit {ns.limit}: must be >= 1")
    if ns.holdout_threshold < 0:
        raise LoadError(f"--holdout-threshold {ns.holdout_threshold}: must be >= 0")
    if ns.holdout_check == "off" and ns.holdout_threshold != DEFAULT_THRESHOLD:
        raise LoadError(
            "--holdout-threshold is the gap --holdout-check on refuses, and --holdout-check off "
            "runs no check: leave the threshold out, or pass --holdout-check on"
        )
    if ns.device == "cuda" and not torch.cuda.is_available():
        raise LoadError("--device cuda: no CUDA device is available here; use --device cpu")
    tasks = [t.strip() for t in ns.tasks.split(",") if t.strip()]
    if not tasks:
        raise LoadError("--tasks is empty: name at least one lm-eval task")
    return tasks


def _score(
    ns: argparse.Namespace, lm: Any, model: Any, tasks: list[str], tm: Any, progress: Progress
) -> dict[str, Any]:
    """lm-eval's simple_evaluate over ``tasks``, a progress line per scored batch."""
    from lm_eval import simple_evaluate

    progress.new_loop()
    forwards = 0

    def scored(*_) -> None:  # a forward hook (torch's API): counts batches for the progress line
        nonlocal forwards
        forwards += 1
        progress.tick(
            lambda: f"scoring: {count(forwards, 'batch')} of up to {ns.batch_size} scored"
        )

    with quiet_scoring(), model.register_forward_hook(scored):  # the handle removes the hook
        return simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=tm,
            limit=ns.limit,
            log_samples=True,
            bootstrap_iters=1000,
        )


def _exit_record(rule: Any, lm: Any) -> dict[str, Any]:
    """results.json's scoring.exit: the rule and the mean loops of the scored tokens."""
    return {
        "criterion": rule.criterion,
        "threshold": rule.threshold,
        "max_loops": rule.max_loops,
        "decide_at": None if rule.decide_at is None else sorted(rule.decide_at),
        "scored_tokens": lm.exit_tokens,
        "mean_loops": lm.exit_loops_sum / lm.exit_tokens if lm.exit_tokens else None,
    }


def run(ns: argparse.Namespace) -> str | None:
    """Check, score, write; returns the results folder on rank 0 (None on other ranks)."""
    rank0 = int(os.environ.get("RANK", "0")) == 0
    progress = Progress("lm_eval", stream=None if rank0 else io.StringIO())  # rank 0 speaks
    if rank0:  # importing lm-eval and loading the model are slow and silent
        print(f"lm_eval: loading lm-eval, then the checkpoint {ns.ckpt} ...", flush=True)
    try:
        import lm_eval
    except ImportError:
        raise LoadError("lm-eval is not installed: pip install 'torchtitan_loom[eval]'") from None
    import lm_eval.evaluator  # its slow import before the model loads (lm_eval defers it)

    from torchtitan_loom.components.evaluation.lm_eval_adapter import LoomLM
    from torchtitan_loom.distributed import utils as dist_utils

    tasks = _checked_tasks(ns)
    check_exit_flags(ns.exit, ns.exit_threshold)
    info = dist_utils.init_distributed(ns.device)
    loaded = load(ns.ckpt, device=str(info.device), tokenizer=ns.tokenizer)
    root = ns.out or os.path.join(loaded.checkpoint, "eval_results")  # checked before the scoring:
    out_files.below(root, ns.out or loaded.checkpoint, LoadError)  # never written through a link
    loops = check_loops(ns.loops, loaded.model, ns.beyond)
    rule = exit_rule(ns.exit, ns.exit_threshold, loaded, loops)
    progress.phase(f"step {loaded.step} loaded; indexing the lm-eval tasks")
    tm = _task_manager(ns, tasks)
    holdout = check(
        loaded,
        ns.holdout_check,
        ns.holdout_threshold,
        info.device,
        info.rank,
        info.world_size,
        progress,
    )
    if info.rank == 0 and holdout.recomputed is not None:
        logged = "none logged" if holdout.logged is None else f"logged {holdout.logged:.5f}"
        print(
            f"holdout check ({holdout.mode}): recomputed eval loss {holdout.recomputed:.5f}, {logged}"
        )
    model = loaded.model
    if (
        ns.param_dtype != "fp32"
    ):  # what stays fp32 is the model's call (TrainSpec.inference_fp32_fn)
        cast_model_for_inference(get_train_spec(loaded.name), model, SHORT_DTYPES[ns.param_dtype])
    assert loaded.tokenizer is not None  # load() builds one (need_tokenizer defaults to True)
    lm = LoomLM(model, loaded.tokenizer, info.device, loops, ns.batch_size, exit_rule=rule)
    if info.rank == 0:
        print(f"lm_eval: scoring {', '.join(tasks)} (step {loaded.step}) ...", flush=True)
    res = _score(ns, lm, model, tasks, tm, progress)
    if info.rank != 0:
        return None
    payload = {
        "checkpoint": os.path.abspath(loaded.checkpoint),
        "step": loaded.step,
        "commit": _commit(),
        "model": {
            "name": loaded.name,
            "flavor": loaded.flavor,
            "args": dataclasses.asdict(loaded.args),
        },
        "config": None if loaded.config is None else dataclasses.asdict(loaded.config),
        "scoring": {
            "tasks": tasks,
            "limit": ns.limit,
            "batch_size": ns.batch_size,
            "loops": loops,
            "exit": None if rule is None else _exit_record(rule, lm),
            "param_dtype": ns.param_dtype,
            "capacity": "off",
            "world_size": info.world_size,
            "lm_eval_version": getattr(lm_eval, "__version__", None),
        },
        "holdout": holdout.as_dict(),
        "results": res["results"],
        "samples": _samples(res.get("samples")),
    }
    out = write_results(root, ns.out or loaded.checkpoint, payload)
    print(summary_table(res["results"]))
    print(f"results: {os.path.join(out, 'results.json')}")
    return out


def main(argv: list[str] | None = None) -> int:
    from torchtitan_loom.distributed import utils as dist_utils

    ns = build_parser().parse_args(argv)
    finished = False
    try:
        run(ns)
        finished = True
    except LoadError as exc:
        print(shorten_line(f"lm_eval error: {exc}"), file=sys.stderr)
        return exit_codes.BAD_INPUT
    finally:
        dist_utils.destroy_distributed(wait_for_all=finished)
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
