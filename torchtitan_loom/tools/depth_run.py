"""The measuring half of tools.depth (tools/depth.py is the command line): held-out loss after
every loop up to 2H under each beyond-H policy, and per-token adaptive exit swept over thresholds,
with the forward FLOPs per token of each point. tools/depth_report.py writes what this returns.

What is read and how (tools/depth_settings.Reads): by default the run's held-out eval slice, each
batch run in forwards of the eval's micro-batch rows, with capacity dropping as trained
(as_trained), so the loss after H loops is the eval's. Per forward: loops 1..H once (the
policies agree there), then loops H+1.. from the carry of loop H once per policy. Adaptive: one
pass per (criterion, threshold) up to the deepest adaptive loop
(components/evaluation/adaptive_exit.py), its loops past H under the first --beyond policy.

Forward FLOPs per token (the model's own count, without the backward): a loop's share of the
trained H loops, plus the head once per loop whose prediction is read (fixed depth reads it once,
an adaptive exit after every loop it runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from torchtitan_loom.components.evaluation.adaptive_exit import (
    CRITERIA,
    adaptive_pass,
    decision_loops,
    model_problem,
)
from torchtitan_loom.components.evaluation.loop_by_loop import each_loop
from torchtitan_loom.components.loss import count_valid, token_ce_sum
from torchtitan_loom.components.runtime.messages import count
from torchtitan_loom.tools.progress import Progress


@dataclasses.dataclass
class Sweep:
    """One adaptive point: the criterion, its threshold and the sums of adaptive_exit.ExitPass."""

    criterion: str
    threshold: float
    ce_sum: float = 0.0
    loops_sum: float = 0.0
    tokens: int = 0
    exits: list[int] = dataclasses.field(default_factory=list)

    def add(self, ce_sum: float, loops_sum: float, tokens: int, exits: list[int]) -> None:
        self.ce_sum += ce_sum
        self.loops_sum += loops_sum
        self.tokens += tokens
        self.exits = exits if not self.exits else [a + b for a, b in zip(self.exits, exits)]


@dataclasses.dataclass
class DepthPlan:
    """What to measure: the deepest fixed loop, the policies, the adaptive sweeps."""

    max_loops: int
    policies: tuple[str, ...]
    adaptive_max: int
    thresholds: dict[str, list[float]]
    learned_asked: bool = False
    """--learned was given: a checkpoint without an exit head is refused, not skipped."""


class FlopCount:
    """Forward FLOPs per token: ``loop`` per loop run, ``head`` per prediction read."""

    def __init__(self, model: Any, seq_len: int) -> None:
        no_head = model.flops_per_token(seq_len, head_calls=0)
        self.loop = no_head / model.num_loops / 3.0  # training counts forward + backward (×3)
        self.head = (model.flops_per_token(seq_len, head_calls=1) - no_head) / 3.0

    def fixed(self, loops: int) -> float:
        return loops * self.loop + self.head

    def adaptive(self, mean_loops: float) -> float:
        return mean_loops * (self.loop + self.head)


@torch.no_grad()
def measure(
    model: Any,
    loader: Any,
    plan: DepthPlan,
    progress: Progress,
    forward_rows: int,
    decide_at: dict[str, frozenset[int] | None] | None = None,
) -> dict[str, Any]:
    """Sums over the loader's batches, each run ``forward_rows`` rows at a time (as the trainer's
    eval runs its micro-batches): {"ce": {policy: [CE sum after each loop]}, "sweeps": [Sweep],
    "tokens": N}. Adaptive loops past H (only with adaptive_max > H) use the first policy; a
    criterion exits only after its loops of ``decide_at`` (absent or None: any loop)."""
    ce = {p: [0.0] * plan.max_loops for p in plan.policies}
    sweeps = [Sweep(c, thr) for c in CRITERIA for thr in plan.thresholds.get(c, [])]
    n_tok, n_batches = 0, 0
    for rows in loader:
        for lo in range(0, rows["input_ids"].shape[0], forward_rows):
            batch = {k: v[lo : lo + forward_rows] for k, v in rows.items()}
            _measure_forward(model, batch, plan, ce, sweeps, decide_at or {})
            n_tok += int(count_valid(batch["labels"]))
        n_batches += 1
        line = f"{n_tok:,} held-out tokens measured ({count(n_batches, 'batch')})"
        progress.tick(line)
    return {"ce": ce, "sweeps": sweeps, "tokens": n_tok}


def _measure_forward(
    model: Any,
    batch: dict[str, torch.Tensor],
    plan: DepthPlan,
    ce: dict[str, list[float]],
    sweeps: list[Sweep],
    decide_at: dict[str, frozenset[int] | None],
) -> None:
    """One forward's rows into the sums of measure()."""
    H = model.num_loops
    carry = None
    for t, out in each_loop(model, batch, range(1, H + 1)):  # every policy's loops 1..H: trained
        carry, loss = out.carry, float(token_ce_sum(out.logits_BSV, batch["labels"]))
        for policy in plan.policies:
            ce[policy][t - 1] += loss
    for policy in plan.policies:
        model.set_beyond_policy(policy)
        for t, out in each_loop(model, batch, range(H + 1, plan.max_loops + 1), carry):
            ce[policy][t - 1] += float(token_ce_sum(out.logits_BSV, batch["labels"]))
    model.set_beyond_policy(plan.policies[0])
    for sweep in sweeps:
        sweep.add(
            *adaptive_pass(
                model,
                batch,
                sweep.criterion,
                sweep.threshold,
                plan.adaptive_max,
                decide_at.get(sweep.criterion),
            )
        )


class DepthError(ValueError):
    """Bad input to the tool: one line, exit code 2."""


DEPTH_DIR = "depth"
OUT_NAMES = frozenset({"depth.md", "depth.json", "depth.png"})


def run_depth(
    ckpt_arg: str,
    flags: dict[str, Any],
    out: str | None,
    force: bool,
    plan_of: Any,
    progress: Progress,
    tasks_of: Any = None,
) -> tuple[str, dict[str, Any]]:
    """Load, measure and write; returns (depth.md's path, the report's numbers). ``flags``: the
    keywords of depth_settings.resolve (data, tokens, seq_len, batch_rows, capacity; None: the
    run's eval's). ``plan_of(H)`` builds the DepthPlan once the trained H is known (DepthError
    for a bad one); ``tasks_of(run config)`` the [eval] section whose downstream_tasks are scored
    at each depth (None: none)."""
    from torchtitan_loom.components.data import build_eval_loader, bundled_corpus_path
    from torchtitan_loom.components.data.pack_format import PackError
    from torchtitan_loom.protocols import ExitsPerToken
    from torchtitan_loom.tools import out_files
    from torchtitan_loom.tools.analyze_run import default_out
    from torchtitan_loom.tools.depth_report import report, write_report
    from torchtitan_loom.tools.depth_settings import resolve
    from torchtitan_loom.tools.loading import LoadError, load

    try:
        loaded = load(ckpt_arg, need_tokenizer=False)
    except LoadError as exc:
        raise DepthError(str(exc)) from None
    if not isinstance(loaded.model, ExitsPerToken):
        raise DepthError(f"{loaded.checkpoint}: a {loaded.name} model has no per-token exit")
    plan = learned_plan(plan_of(loaded.model.num_loops), loaded.model)
    run_cfg = loaded.config
    decide_at = _decide_at(plan, loaded)
    tasks = None if tasks_of is None else tasks_of(run_cfg)
    if tasks is not None:  # before the slow part: an unknown task fails now
        from torchtitan_loom.components.evaluation.downstream import unknown_tasks

        dir_ = tasks.downstream_tasks_dir or None
        unknown = unknown_tasks(list(tasks.downstream_tasks), dir_, tasks.downstream_only_tasks_dir)
        if unknown:
            raise DepthError(f"--tasks: {unknown[0]}")
    owner = out  # --out: the user's folder (a link there is theirs)
    if out is None:
        dump = {"job": {"dump_folder": run_cfg.job.dump_folder}} if run_cfg is not None else {}
        out, owner = default_out(loaded.checkpoint, dump, loaded.step, DEPTH_DIR)
    out_files.check_out(out, force, OUT_NAMES, DepthError, owner)  # before the slow part
    pack = str(loaded.pack_path) if loaded.pack_path else str(bundled_corpus_path(None))
    reads = resolve(run_cfg, pack, trained_only(loaded), loaded.args.max_seq_len, **flags)
    try:
        loader = build_eval_loader(
            reads.data,
            seq_len=reads.seq_len,
            vocab_size=loaded.args.vocab_size,
            batch_rows=reads.rows,
            dp_rank=0,
            dp_world=1,
            val_path=reads.val_path,
            max_tokens=reads.tokens,
        )
    except (PackError, ValueError, OSError) as exc:
        raise DepthError(f"held-out data {reads.val_path or reads.data}: {exc}") from None
    model = as_trained(loaded) if reads.as_trained else loaded.model
    progress.phase(
        f"step {loaded.step} loaded (H={model.num_loops}); loops 1..{plan.max_loops} under "
        f"{' and '.join(plan.policies)}, then "
        f"{sum(len(v) for v in plan.thresholds.values())} adaptive sweeps, over {reads.source()}"
    )
    sums = measure(model, loader, plan, progress, reads.forward_rows, decide_at)
    if sums["tokens"] == 0:
        raise DepthError(f"held-out data {reads.data}: no valid tokens; pass --data with a holdout")
    numbers = report(sums, plan, FlopCount(model, reads.seq_len), loaded, reads)
    if tasks is not None and tasks.downstream_tasks:
        numbers["task_scores"] = task_scores(loaded, tasks, plan, progress)
    progress.phase(f"writing depth.md, depth.json and depth.png to {out}")
    try:
        out_files.clear_out(out, force, OUT_NAMES, DepthError, owner)
        out_files.make_out(out, DepthError, owner)
        return write_report(numbers, out), numbers
    except OSError as exc:
        raise DepthError(f"{out}: cannot write the report: {exc}") from None


def _decide_at(plan: DepthPlan, loaded: Any) -> dict[str, frozenset[int] | None]:
    """Each swept criterion's decision loops (adaptive_exit.decision_loops: the learned head
    decides where its run trained it to, the segment ends), or DepthError."""
    training = None if loaded.config is None else loaded.config.training
    try:
        return {
            c: decision_loops(c, loaded.args.num_loops, training)
            for c, t in plan.thresholds.items()
            if t
        }
    except ValueError as exc:
        raise DepthError(f"--learned: {exc}") from None


def learned_plan(plan: DepthPlan, model: Any) -> DepthPlan:
    """The plan without the learned sweep on a model without an exit head (its default), or
    DepthError when --learned asked for one."""
    problem = model_problem("learned", model)
    if problem and plan.learned_asked:
        raise DepthError(f"--learned: {problem}")
    if problem:
        return dataclasses.replace(plan, thresholds={**plan.thresholds, "learned": []})
    return plan


def trained_only(loaded: Any) -> str:
    """How the trained model arguments differ from the decoding ones the loader built (the spec's
    portable_args: e.g. MoE capacity dropping), as "key = value, ..."; "" when they do not."""
    from torchtitan_loom.protocols import get_train_spec, portable_args

    spec = get_train_spec(loaded.name)
    trained = dataclasses.asdict(portable_args(spec, loaded.args, decoding=False))
    decoding = dataclasses.asdict(portable_args(spec, loaded.args, decoding=True))
    return ", ".join(f"{k} = {v}" for k, v in trained.items() if decoding.get(k) != v)


def as_trained(loaded: Any) -> Any:
    """The loaded model with the trained model args (capacity dropping as trained, which the
    inference loader turns off), sharing its tensors (no copy); in eval mode."""
    from torchtitan_loom.protocols import get_train_spec, portable_args

    spec = get_train_spec(loaded.name)
    with torch.device("meta"):
        model = type(loaded.model)(portable_args(spec, loaded.args, decoding=False))
    model.load_state_dict(loaded.model.state_dict(), assign=True)
    return model.eval()


def task_scores(loaded: Any, tasks: Any, plan: DepthPlan, progress: Progress) -> dict[str, Any]:
    """The downstream tasks of ``tasks`` (an [eval] section) scored after each of loops
    1 .. plan.max_loops (past H under the first policy), through the trainer's own scorer."""
    from torchtitan_loom.components.evaluation.downstream import DownstreamScorer
    from torchtitan_loom.tools.loading import LoadError, load_tokenizer

    try:
        tokenizer = load_tokenizer(loaded.pack_path, None, loaded.args.vocab_size)
    except LoadError as exc:
        raise DepthError(f"task scores: {exc}") from None
    scorer = DownstreamScorer(
        tasks,
        model=loaded.model,
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        autocast=contextlib.nullcontext,
        stop_requested=lambda: 0,
        log=lambda line: print(f"depth: {line}", flush=True),
    )

    loaded.model.set_beyond_policy(plan.policies[0])
    rows = []
    for t in range(1, plan.max_loops + 1):
        rows.append({"loops": t, "scores": scorer.score(loaded.step or 0, loops=t) or {}})
    return {"tasks": list(tasks.downstream_tasks), "policy": plan.policies[0], "by_loops": rows}
