"""Downstream scores during training: lm-eval tasks on the live model, through the adapter of
tools.lm_eval (components/evaluation/lm_eval_adapter.py), logged as ``downstream/<task>/<metric>``.

Every rank scores every request: with a sharded model every rank takes part in every forward,
so the ranks cannot split the requests as the offline tool does. The random state of the run is
put back after scoring (lm-eval seeds Python, NumPy and torch), so training continues exactly as
it would have. A stop signal ends the scoring between two batches (``ScoringStopped``).
"""

from __future__ import annotations

import difflib
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torchtitan_loom.components.runtime.stderr_filter import dropping_stderr_lines, progress_bar

# lm-eval result entries that are not a score.
_NOT_SCORES = ("alias", "sample_len", "samples")


def task_manager(tasks_dir: str | None, only_tasks_dir: bool):
    """lm-eval's TaskManager over its own tasks (unless only_tasks_dir) and `tasks_dir`."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=tasks_dir, include_defaults=not only_tasks_dir)


def unknown_tasks(
    tasks: list[str], tasks_dir: str | None, only_tasks_dir: bool, manager: Any = None
) -> list[str]:
    """One message per task name lm-eval does not know (with the nearest names), else []."""
    known = set((manager or task_manager(tasks_dir, only_tasks_dir)).all_tasks)
    out = []
    for name in tasks:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3)
            out.append(
                f"lm-eval knows no task {name!r}"
                + (f"; did you mean {', '.join(near)}?" if near else "")
            )
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


class DownstreamScorer:
    """Built once by the trainer (the task index is read once); ``score(step)`` after the steps
    ``eval.downstream_interval`` asks for.

    Args:
        cfg: the ``[eval]`` config section (``downstream_*``).
        model: the training model (ModelProtocol); put in eval mode while scoring, then back.
        tokenizer: the training pack's tokenizer.
        autocast: the step's autocast context, around every forward (the same numerics as training).
        stop_requested: asked before every batch; truthy drops the scores of this round.
    """

    def __init__(
        self,
        cfg: Any,
        *,
        model: Any,
        tokenizer: Any,
        device: torch.device,
        autocast: Callable[[], Any],
        stop_requested: Callable[[], int],
        log: Callable[[str], None],
    ) -> None:
        self.cfg, self.model, self.tokenizer, self.device, self.log = (
            cfg,
            model,
            tokenizer,
            device,
            log,
        )
        self._autocast, self._stop_requested = autocast, stop_requested
        self.manager = task_manager(cfg.downstream_tasks_dir or None, cfg.downstream_only_tasks_dir)

    def due(self, step: int, last_step: int) -> bool:
        every = self.cfg.downstream_interval
        return bool(every) and (step % every == 0 or step == last_step)

    def score(self, step: int, loops: int | None = None) -> dict[str, float] | None:
        """The scores after all loops, or after loop ``loops`` (the depth report; see flat_scores),
        with a start and a done line; None when a stop signal interrupted them (dropped, as an
        interrupted eval is). The model is left in training mode unless it came in eval mode."""
        from lm_eval import simple_evaluate

        from torchtitan_loom.components.evaluation.lm_eval_adapter import LoomLM, ScoringStopped

        cfg = self.cfg
        limit = f" (at most {cfg.downstream_limit} documents each)" if cfg.downstream_limit else ""
        depth = "" if loops is None else f" after loop {loops}"
        self.log(f"downstream at step {step}{depth}: {', '.join(cfg.downstream_tasks)}{limit} ...")
        started = time.perf_counter()
        lm = LoomLM(
            self.model,
            self.tokenizer,
            self.device,
            self.model.num_loops if loops is None else loops,
            batch_size=cfg.downstream_batch_size,
            split_over_ranks=False,
            should_stop=lambda: bool(self._stop_requested()),
            forward_context=self._autocast,
        )
        states = random.getstate(), np.random.get_state()
        devices = [self.device] if self.device.type == "cuda" else []
        was_training = self.model.training
        self.model.eval()
        try:
            with (
                dropping_stderr_lines(_lm_eval_noise),
                torch.random.fork_rng(devices=devices, device_type=self.device.type),
            ):
                res = simple_evaluate(
                    model=lm,
                    tasks=list(cfg.downstream_tasks),
                    task_manager=self.manager,
                    limit=cfg.downstream_limit or None,
                    log_samples=False,
                    bootstrap_iters=0,
                    verbosity="ERROR",
                )
        except ScoringStopped:
            self.log(
                f"downstream at step {step}: stopped by a signal after {time.perf_counter() - started:.1f} s, "
                "its scores are dropped"
            )
            return None
        finally:
            self.model.train(was_training)
            random.setstate(states[0])
            np.random.set_state(states[1])
        scores = flat_scores(res["results"])
        shown = (
            ", ".join(f"{k[len('downstream/') :]} {v:.4f}" for k, v in scores.items())
            or "no scores"
        )
        self.log(f"downstream done in {time.perf_counter() - started:.1f} s: {shown}")
        return scores


# What lm-eval prints while it scores that a training run's console does not need: its per-task
# hint about --metadata (a CLI this run does not use), tqdm bars over the requests it builds, and
# git's complaint when the working directory is no repository (lm-eval records a commit hash).
_LM_EVAL_NOISE = (
    "Custom kwargs can be passed to `--metadata`",
    "For example --metadata=",
    "fatal: not a git repository",
)


def _lm_eval_noise(line: str) -> bool:
    return progress_bar(line) or any(text in line for text in _LM_EVAL_NOISE)


def build_scorer(
    cfg: Any,
    *,
    model: Any,
    data_path: str,
    tokenizer_name: str | None,
    vocab_size: int,
    device: torch.device,
    autocast: Callable[[], Any],
    stop_requested: Callable[[], int],
    log: Callable[[str], None],
) -> DownstreamScorer | None:
    """The run's scorer (None when eval.downstream_interval is 0), with the training pack's tokenizer."""
    if not cfg.downstream_interval:
        return None
    from pathlib import Path

    from torchtitan_loom.components.data import PackError
    from torchtitan_loom.components.data.pack_tokenizer import TokenizerError, pack_tokenizer

    try:
        tokenizer = pack_tokenizer(Path(data_path), tokenizer_name, vocab_size)
    except TokenizerError as exc:
        raise PackError(f"downstream scoring: {exc}") from None
    return DownstreamScorer(
        cfg,
        model=model,
        tokenizer=tokenizer,
        device=device,
        autocast=autocast,
        stop_requested=stop_requested,
        log=log,
    )
