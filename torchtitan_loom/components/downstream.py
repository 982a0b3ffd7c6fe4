"""Downstream scores during training: lm-eval tasks on the live model, through the adapter of
tools.lm_eval (tools/lm_eval_adapter.py), logged as ``downstream/<task>/<metric>``.

Every rank scores every request: with a sharded model every rank takes part in every forward,
so the ranks cannot split the requests as the offline tool does. The random state of the run is
put back after scoring (lm-eval seeds Python, NumPy and torch), so training continues exactly as
it would have. A stop signal ends the scoring between two batches (``ScoringStopped``).
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# lm-eval result entries that are not a score.
_NOT_SCORES = ("alias", "sample_len", "samples")


def task_manager(tasks_dir: str | None, only_tasks_dir: bool):
    """lm-eval's TaskManager over its own tasks (unless only_tasks_dir) and `tasks_dir`."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=tasks_dir, include_defaults=not only_tasks_dir)


def unknown_tasks(tasks: list[str], tasks_dir: str | None, only_tasks_dir: bool,
                  manager: Any = None) -> list[str]:
    """One message per task name lm-eval does not know (with the nearest names), else []."""
    known = set((manager or task_manager(tasks_dir, only_tasks_dir)).all_tasks)
    out = []
    for name in tasks:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3)
            out.append(f"lm-eval knows no task {name!r}" + (f"; did you mean {', '.join(near)}?" if near else ""))
    return out


def flat_scores(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """{"downstream/<task>/<metric>": value} from lm-eval's results; the metric is lm-eval's
    ``metric,filter`` key with a ``none`` filter dropped (``acc,none`` → ``acc``); stderr left out."""
    out = {}
    for task, metrics in sorted(results.items()):
        for key, value in sorted(metrics.items()):
            if key in _NOT_SCORES or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            out[f"downstream/{task}/{name}"] = float(value)
    return out


class ScoringStopped(Exception):
    """A stop signal arrived while scoring: the scores of this round are dropped."""


class DownstreamScorer:
    """Scores a model on the configured tasks (built once, so the task index is read once)."""

    def __init__(self, tasks: list[str], tasks_dir: str | None, only_tasks_dir: bool, limit: int,
                 batch_size: int, tokenizer: Any, device: torch.device) -> None:
        self.tasks, self.limit, self.batch_size = list(tasks), limit or None, batch_size
        self.tokenizer, self.device = tokenizer, device
        self.manager = task_manager(tasks_dir, only_tasks_dir)

    def score(self, model: Any, loops: int, should_stop: Callable[[], bool],
              context: Callable[[], Any]) -> dict[str, float]:
        """lm-eval's scores of `model` after `loops` loops, flattened (see flat_scores); raises
        ScoringStopped when should_stop() turns true. `context()` wraps every forward (autocast)."""
        from lm_eval import simple_evaluate

        from torchtitan_loom.tools.lm_eval_adapter import LoomLM

        lm = LoomLM(model, self.tokenizer, self.device, loops, batch_size=self.batch_size,
                    split_over_ranks=False, should_stop=should_stop, forward_context=context)
        states = random.getstate(), np.random.get_state()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices, device_type=self.device.type):
                res = simple_evaluate(model=lm, tasks=self.tasks, task_manager=self.manager, limit=self.limit,
                                      log_samples=False, bootstrap_iters=0, verbosity="ERROR")
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
        return flat_scores(res["results"])


def describe(scores: dict[str, float]) -> str:
    """``task/metric value, ...`` for the done line."""
    return ", ".join(f"{k[len('downstream/'):]} {v:.4f}" for k, v in scores.items()) or "no scores"


def build_scorer(eval_cfg: Any, data_path: str, tokenizer_override: str | None, vocab_size: int,
                 device: torch.device) -> DownstreamScorer | None:
    """The run's scorer (None when eval.downstream_interval is 0), with the training pack's tokenizer."""
    if not eval_cfg.downstream_interval:
        return None
    from pathlib import Path

    from torchtitan_loom.components.data import PackError
    from torchtitan_loom.tools.loading import LoadError, load_tokenizer

    try:
        tokenizer = load_tokenizer(Path(data_path), tokenizer_override, vocab_size)
    except LoadError as exc:
        raise PackError(f"downstream scoring: {exc}") from None
    return DownstreamScorer(eval_cfg.downstream_tasks, eval_cfg.downstream_tasks_dir or None,
                            eval_cfg.downstream_only_tasks_dir, eval_cfg.downstream_limit,
                            eval_cfg.downstream_batch_size, tokenizer, device)
