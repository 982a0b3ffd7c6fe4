"""Producers of the regions that show training runs and the tools run on them: the README's tour,
the run and install times, the analysis report, the metrics size, the diagnostics cost, and the
after-training tools (sampling, lm-eval, the HF export)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from docs_context import (
    ANALYZE,
    DEFAULT_RUN,
    DIAG_COST,
    GENERATE,
    HEATMAP,
    HF_EXPORT,
    HF_SNIPPET,
    HF_SNIPPET_BODY,
    LM_EVAL,
    METRICS_SIZE,
    SHORT_RUN,
    STEP_RE,
    Context,
    block,
    last_eval,
    last_table,
    loop_losses,
    prose,
)
from docs_runner import ROOT, duration, machine
from docs_tour_figures import after_console, cpu_kind, figures, record

# ----- README


def default_run_console(ctx: Context) -> str:
    """The default run's console: the header, the first logged step, the first and the last eval."""
    res = ctx.run(DEFAULT_RUN)
    record(cpu_kind(), figures=figures(res.console))  # what CI compares on this CPU kind
    lines = res.console.rstrip("\n").split("\n")
    steps = [i for i, ln in enumerate(lines) if STEP_RE.search(ln)]
    evals = [i for i, ln in enumerate(lines) if "] eval at step" in ln]
    keep = set(range(steps[0] + 1))
    if evals:
        first_eval_step = re.search(r"eval at step (\d+)", lines[evals[0]])[1]
        end = next(i for i in steps if STEP_RE.search(lines[i])[1] == first_eval_step)
        keep |= set(range(evals[0], end + 1)) | set(range(evals[-1], len(lines)))
    else:
        keep |= set(range(steps[-1], len(lines)))
    out, cut = [], False
    for i, ln in enumerate(lines):
        if i in keep:
            out.append(ln)
            cut = False
        elif not cut:
            out.append("...")
            cut = True
    return block(res, "\n".join(out))


def train_duration(ctx: Context) -> str:
    res = ctx.run(DEFAULT_RUN)
    corpus = re.search(r"bundled corpus ready in ([\d.]+) s", res.console)
    built = f", {corpus[1]} s of it building the bundled corpus on first use" if corpus else ""
    return prose(
        f"The training run takes {duration(res.cpu_s)} of CPU time{built} ({machine()}); on a quiet "
        f"2-core machine that is about its wall time (with other jobs on the cores it took "
        f"{duration(res.wall_s)} here)."
    )


def install_duration(ctx: Context) -> str:
    # A new virtual environment in the work folder; no pip cache, so only the machine's own wheel
    # folders (pip config find-links, if any) can spare a download, and the text says which.
    pip = "/tmp/venv/bin/python -m pip install -q --no-cache-dir"
    base = ctx.runner.run(f"python -m venv /tmp/venv && {pip} torch==2.13.0 && {pip} -e .")
    extras = ctx.runner.run(f'{pip} -e ".[dev,eval,hf,data,wandb]"')
    return prose(
        f"Installing into a new virtual environment took {duration(base.wall_s)} of wall time "
        f"({duration(base.cpu_s)} of CPU time) for the first command and {duration(extras.wall_s)} "
        f"({duration(extras.cpu_s)} of CPU time) more for the test extras (lm-eval, transformers, datasets, "
        f"wandb), with other jobs on the cores; {_wheel_source()}"
    )


def _wheel_source() -> str:
    """Where pip found the packages: a local wheel folder (find-links) makes an install a fraction
    of what a newcomer downloading torch (the CPU wheel alone is ~190 MB) waits."""
    links = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    if links:
        return (
            f"pip could take packages from this machine's wheel folder ({links}) instead of "
            "downloading them; over a network add the download of torch (~190 MB for the CPU wheel) "
            "and the extras."
        )
    return "every package downloaded (no pip cache), so the network's speed counts."


def suite_duration(ctx: Context) -> str:
    text = ctx.suite_log.read_text(errors="replace")
    summary = [ln for ln in text.splitlines() if re.search(r"\d+ passed.* in [\d.]+s", ln)][-1]
    secs = float(re.search(r" in ([\d.]+)s", summary)[1])
    counts = re.sub(r"=+|\s+in [\d.]+s.*$", "", summary).strip()
    return prose(f"The test suite takes about {duration(secs)} on a 2-core machine ({counts}).")


# ----- docs/inside_the_loops.md


def metrics_size(ctx: Context) -> str:
    res = ctx.run(METRICS_SIZE)
    v = {
        m[1]: float(m[2].replace(",", ""))
        for m in re.finditer(r"^\s*(\S+): ([\d,]+)", res.stdout, re.M)
    }
    return (
        block(res, res.stdout)
        + "\n\n"
        + prose(
            f"For `loom_1p7b` (log every 10 steps, eval every 500) that is {v['per_1000_steps_eval_only'] / 1e6:.2f} "
            f"MB of metrics.jsonl per 1,000 steps by default against {v['per_1000_steps_every_row'] / 1e6:.1f} MB "
            f"with `expert_load` on every logged row (a row is {v['train']:,.0f} bytes without it, "
            f"{v['train+load']:,.0f} bytes with it)."
        )
    )


def diag_cost(ctx: Context) -> str:
    res = ctx.run(DIAG_COST)
    rows = last_table(res.stdout)
    shares = [float(r.split("|")[-2].strip().lstrip("+").rstrip("%")) for r in rows[2:] if "%" in r]
    return (
        "```\n$ "
        + DIAG_COST
        + "\n```\n\n"
        + "\n".join(rows)
        + "\n\n"
        + prose(
            f"At the presets' diag_interval of 50 no switch adds more than {max(max(shares), 0):.2f}% "
            f"of step time here (the target is under 3%)."
        )
    )


def analysis_tables(ctx: Context) -> str:
    body, heatmap = analysis_text(ctx)
    shutil.copyfile(heatmap, ROOT / HEATMAP)
    record(cpu_kind(), analysis=after_console(body))
    return body


def analysis_text(ctx: Context) -> tuple[str, Path]:
    """The region's text and the heatmap it shows (written by the analysis into the work folder);
    deterministic given the default run, so the tour's check compares it too."""
    train = ctx.run(DEFAULT_RUN)
    res = ctx.run(ANALYZE)
    out = Path(ctx.runner.real("/tmp/loom_analysis"))
    report = (out / "report.md").read_text().split("\n")
    tables, cur = [], []
    for ln in report + [""]:
        if ln.startswith("|"):
            cur.append(ln)
        elif cur:
            tables.append(cur)
            cur = []
    losses, per_layer, per_loop = tables[:3]
    step = re.search(r"\(step (\d+)\)", "\n".join(report))[1]
    loss = " / ".join(c.strip() for c in losses[2].split("|")[2:-1])
    overlap = float(per_layer[-1].split("|")[3])
    return (
        "```\n$ "
        + train.command
        + "\n$ "
        + res.command
        + "\n"
        + res.stdout.rstrip("\n")
        + "\n```\n\n"
        f"At step {step} (held-out loss after loop 1 / 2 / 3: {loss}):\n\n"
        + "\n".join(per_layer)
        + "\n\n"
        + "\n".join(per_loop)
        + "\n\n"
        + prose(
            f"Consecutive loops keep {overlap:.0%} of a token's experts (mean over layers and loops). "
            f"Expert load of layer 0 (the picture TensorBoard shows as `routing/load_layer_0`):"
        )
        + "\n\n"
        "![expert load, layer 0, default debug run](routing_heatmap_debug.png)"
    ), out / "load_layer_0.png"


# ----- docs/after_training.md


def short_run(ctx: Context) -> str:
    if (
        DEFAULT_RUN not in ctx.cache
    ):  # build the corpus first, so this run's time is training and eval only
        ctx.once(
            "corpus",
            lambda: ctx.runner.python(
                "from torchtitan_loom.components.data import bundled_corpus_path; bundled_corpus_path(None)"
            ),
        )
    res = ctx.run(SHORT_RUN)
    row = last_eval(ctx, "/tmp/loom_debug")
    return (
        block(res, "")
        + "\n\n"
        + prose(
            f"({duration(res.cpu_s)} of CPU time, {duration(res.wall_s)} of wall time, "
            f"{machine()}; eval loss after loop 1 / 2 / 3 at step {row['step']}: {loop_losses(row)}.)"
        )
    )


def generate_console(ctx: Context) -> str:
    ctx.run(SHORT_RUN)
    res = ctx.run(GENERATE)
    return block(res, res.stdout)


def lm_eval_console(ctx: Context) -> str:
    ctx.run(SHORT_RUN)
    res = ctx.run(LM_EVAL)
    return (
        block(res, res.stdout)
        + "\n\n"
        + prose(
            f"({duration(res.wall_s)}; `--only-tasks-dir` skips indexing "
            f"lm-eval's own task configs.)"
        )
    )


def hf_export_console(ctx: Context) -> str:
    ctx.run(SHORT_RUN)
    export = ctx.run(HF_EXPORT)
    snippet = ctx.run(HF_SNIPPET + "\n" + HF_SNIPPET_BODY)
    return (
        "```\n$ "
        + HF_EXPORT
        + "\n"
        + export.stdout.rstrip("\n")
        + "\n$ "
        + HF_SNIPPET
        + "\n"
        + HF_SNIPPET_BODY
        + "\n"
        + snippet.stdout.rstrip("\n")
        + "\n```"
    )
