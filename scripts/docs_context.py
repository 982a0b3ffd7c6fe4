"""What every docs producer shares: the commands the docs show, the Producer record, the Context
that runs a command once for all the regions that show it, and the text helpers.

A producer marked ``needs`` is only run when its input is given on the command line of
refresh_docs.py (a fresh install into a new virtual environment, or the log of a full test run);
without it, its region keeps its text and the refresh says so. ``sources`` are the paths its
region describes (scripts/docs_stamps.py); ``check`` says how CI checks the region against the
tree without a refresh: "exact" (cheap and deterministic: CI reruns the producer and compares the
text), "figures" (the README tour and the analysis of its run: CI reruns the tour's command and
compares every loss figure, and the analysis text, tests/unit/test_docs_tour.py), or None (too slow or timed: the stamp says what it was made on).
"""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from docs_runner import Result, Runner

DEFAULT_RUN = "./run_train.sh --checkpoint.enable --job.dump_folder /tmp/loom_default"
SHORT_RUN = (
    "./run_train.sh --checkpoint.enable --training.steps 60 --eval.interval 30 --checkpoint.interval 30 \\\n"
    "    --job.dump_folder /tmp/loom_debug"
)
ANALYZE = (
    "python -m torchtitan_loom.tools.analyze /tmp/loom_default --tokens 50000 --batch-rows 16 "
    "--out /tmp/loom_analysis"
)
GENERATE = (
    'python -m torchtitan_loom.tools.generate /tmp/loom_debug --prompt "variables:\n'
    'q=9; z=q*2; h=z-7;" --max-new-tokens 40 --temperature 0 --loops 2'
)
LM_EVAL = (
    "python -m torchtitan_loom.tools.lm_eval /tmp/loom_debug --tasks loom_story_mc,loom_tiny_mc \\\n"
    "    --tasks-dir tests/inference/tiny_tasks --only-tasks-dir"
)
HF_EXPORT = "python -m torchtitan_loom.tools.export /tmp/loom_debug /tmp/loom_debug_hf --format hf"
HF_SNIPPET = "python - <<'PY'"
HF_SNIPPET_BODY = """import logging
for noisy in ("torchao", "torch.utils._pytree"):  # import-time notices of a library transformers loads
    logging.getLogger(noisy).setLevel(logging.ERROR)  # (see below); every other warning still shows
from transformers import PreTrainedTokenizerFast, pipeline
tok = PreTrainedTokenizerFast.from_pretrained("/tmp/loom_debug_hf")  # the exported tokenizer.json
print(tok("q=9;")["input_ids"], tok.eos_token, tok.eos_token_id)     # byte tokenizer: ids = bytes
generate = pipeline("text-generation", model="/tmp/loom_debug_hf", trust_remote_code=True)
print(generate("variables:\\nq=9; z=q*2; h=z-7;", max_new_tokens=30, do_sample=False)[0]["generated_text"])
PY"""
DRY_RUN = (
    "python -m torchtitan_loom.train --job.config_file train_configs/loom_1p7b.toml \\\n"
    "    --parallelism.dry_run --parallelism.dry_run_world_size 64 --parallelism.dp_replicate 2 --parallelism.ep 2"
)
MEMORY_TIME = "python benchmarks/memory_time.py --steps 2"
ESTIMATE = "python -m torchtitan_loom.train --job.config_file train_configs/loom_1p7b.toml --parallelism.dry_run"
ESTIMATE_SHOWN = (
    ESTIMATE.replace(" --parallelism.dry_run", " --parallelism.dry_run \\\n   ")
    + " --parallelism.dry_run_world_size 8     # and 64; 512 with --training.micro_batch_size 2"
)
RESHARD = "python benchmarks/memory_time.py --reshard --steps 3"
METRICS_SIZE = "python benchmarks/metrics_size.py"
MOE_BY_OP = "python benchmarks/moe_layer.py --table by_op"
DIAG_COST = "python benchmarks/diag_cost.py --cpu --preset debug --rounds 10 --out /tmp/diag_cost"
PRESETS = ("debug_model", "loom_329m", "loom_1p7b")
HEATMAP = "docs/routing_heatmap_debug.png"
STEP_RE = re.compile(r"\] step +(\d+)(?:/\d+)? \|")  # "step 10 |" or "step 10/180 |"


RUNS = (
    "torchtitan_loom",
    "train_configs",
    "run_train.sh",
)  # what a training run's figures describe


@dataclass(frozen=True)
class Producer:
    commands: tuple[str, ...]  # the commands its region shows after '$ ', in order
    fn: Callable[[Context], str]
    needs: str | None = None  # "install" or "suite_log": runs only when that input is given
    sources: tuple[str, ...] = RUNS  # the paths the region describes (its stamp's digest)
    check: str | None = None  # "exact", "figures" or None (see the module docstring)


@dataclass
class Context:
    runner: Runner
    install: bool = False
    suite_log: Path | None = None
    cache: dict = field(default_factory=dict)

    def once(self, key: str, make: Callable[[], object]):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def run(self, command: str) -> Result:
        def fresh() -> (
            Result
        ):  # a rerun in a kept work folder starts a new run, as the docs' reader does
            for folder in re.findall(r"--job\.dump_folder (\S+)", command):
                shutil.rmtree(self.runner.real(folder), ignore_errors=True)
            return self.runner.run(command)

        return self.once(command, fresh)


def prose(text: str, indent: str = "") -> str:
    """A generated sentence wrapped like the hand-written text around it."""
    return textwrap.fill(
        text, 100, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def block(result: Result, body: str) -> str:
    body = body.rstrip("\n")
    return "```\n$ " + result.command + ("\n" + body if body else "") + "\n```"


def metrics_rows(ctx: Context, folder: str) -> list[dict]:
    path = Path(ctx.runner.real(folder)) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def last_eval(ctx: Context, folder: str) -> dict:
    return [r for r in metrics_rows(ctx, folder) if r.get("eval_loss") is not None][-1]


def loop_losses(row: dict) -> str:
    n = sum(1 for k in row if k.startswith("eval_loss_loop_"))
    return " / ".join(f"{row[f'eval_loss_loop_{t}']:.4f}" for t in range(1, n + 1))


def last_table(stdout: str) -> list[str]:
    """The last markdown table a benchmark printed (it prints rows as they finish, then the table)."""
    lines = stdout.rstrip("\n").split("\n")
    end = max(i for i, ln in enumerate(lines) if ln.startswith("|"))
    start = end
    while start > 0 and lines[start - 1].startswith("|"):
        start -= 1
    rows = lines[start : end + 1]
    header = rows.index(next(r for r in rows if r.startswith("|---")))
    return rows[header - 1 :]
