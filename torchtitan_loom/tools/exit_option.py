"""``--exit CRITERION --exit-threshold X`` of generate and lm_eval: the per-token exit rule of a
loaded checkpoint (components/evaluation/adaptive_exit.py), or one LoadError line."""

from __future__ import annotations

from typing import Any

from torchtitan_loom.tools.input_files import LoadError

THRESHOLD_EXAMPLES = "kl ≥ 0, e.g. 0.1; confidence in [0, 1], e.g. 0.2; learned ≥ 0 nats, e.g. 0.02"


def check_exit_flags(criterion: str | None, threshold: float | None) -> None:
    """The two flags alone, before anything is loaded: both or neither, a known criterion, a
    threshold in its range (0 would exit no token: a silent no-op, so it is asked for)."""
    from torchtitan_loom.components.evaluation.adaptive_exit import threshold_problem

    if threshold is not None and criterion is None:
        raise LoadError("--exit-threshold needs --exit kl, confidence or learned")
    if criterion is None:
        return
    problem = threshold_problem(criterion, 0.0 if threshold is None else threshold)
    if problem:
        raise LoadError(f"--exit {problem}")
    if threshold is None:
        raise LoadError(
            f"--exit {criterion} needs --exit-threshold X: a token stops once the criterion is "
            f"below X ({THRESHOLD_EXAMPLES}; 0 = fixed depth)"
        )


def exit_rule(criterion: str | None, threshold: float | None, loaded: Any, loops: int) -> Any:
    """adaptive_exit.ExitRule on ``loaded`` (tools/loading.Loaded) up to ``loops``; None without
    --exit. The learned head is asked only where its run trained it to decide (decision_loops)."""
    from torchtitan_loom.components.evaluation.adaptive_exit import (
        ExitRule,
        decision_loops,
        model_problem,
    )

    check_exit_flags(criterion, threshold)
    if criterion is None or threshold is None:
        return None
    try:
        problem = model_problem(criterion, loaded.model)
        if problem:
            raise ValueError(problem)
        training = None if loaded.config is None else loaded.config.training
        decide_at = decision_loops(criterion, loaded.args.num_loops, training)
    except ValueError as exc:
        raise LoadError(f"--exit {exc}") from None
    return ExitRule(criterion, threshold, loops, decide_at)
