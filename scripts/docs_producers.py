"""One producer per marked region of the docs: the commands it runs (as the docs show them) and the
text it writes from what they printed. Runs that feed several regions (the default run, the short
run with checkpoints) happen once, on first use.

A producer marked ``needs`` is only run when its input is given on the command line of
refresh_docs.py (a fresh install into a new virtual environment, or the log of a full test run);
without it, its region keeps its text and the refresh says so.
"""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from docs_runner import ROOT, Result, Runner, duration, machine

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
HF_SNIPPET_BODY = """from transformers import PreTrainedTokenizerFast, pipeline
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


@dataclass(frozen=True)
class Producer:
    commands: tuple[str, ...]  # the commands its region shows after '$ ', in order
    fn: Callable[["Context"], str]
    needs: str | None = None  # "install" or "suite_log": runs only when that input is given


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


def _metrics_rows(ctx: Context, folder: str) -> list[dict]:
    path = Path(ctx.runner.real(folder)) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _last_eval(ctx: Context, folder: str) -> dict:
    return [r for r in _metrics_rows(ctx, folder) if r.get("eval_loss") is not None][-1]


def _loop_losses(row: dict) -> str:
    n = sum(1 for k in row if k.startswith("eval_loss_loop_"))
    return " / ".join(f"{row[f'eval_loss_loop_{t}']:.4f}" for t in range(1, n + 1))


# ----- README


def default_run_console(ctx: Context) -> str:
    """The default run's console: the header, the first logged step, the first and the last eval."""
    res = ctx.run(DEFAULT_RUN)
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
    pip = "/tmp/venv/bin/python -m pip install -q"  # a new virtual environment in the work folder
    base = ctx.runner.run(f"python -m venv /tmp/venv && {pip} torch==2.13.0 && {pip} -e .")
    extras = ctx.runner.run(f'{pip} -e ".[dev,eval,hf,data,wandb]"')
    return prose(
        f"Installing into a new virtual environment took {duration(base.wall_s)} of wall time "
        f"({duration(base.cpu_s)} of CPU time) for the first command and {duration(extras.wall_s)} "
        f"({duration(extras.cpu_s)} of CPU time) more for the test extras (lm-eval, transformers, datasets, "
        f"wandb), with pip's downloads served from this machine's wheel cache and other jobs on the cores; "
        f"over a network add the download of torch and the extras."
    )


def suite_duration(ctx: Context) -> str:
    text = ctx.suite_log.read_text(errors="replace")
    summary = [ln for ln in text.splitlines() if re.search(r"\d+ passed.* in [\d.]+s", ln)][-1]
    secs = float(re.search(r" in ([\d.]+)s", summary)[1])
    counts = re.sub(r"=+|\s+in [\d.]+s.*$", "", summary).strip()
    return prose(f"The test suite takes about {duration(secs)} on a 2-core machine ({counts}).")


# ----- docs/configuration.md


def preset_sizes(ctx: Context) -> str:
    code = (
        "import json, torch\n"
        "from torchtitan_loom.config import load_config\n"
        "from torchtitan_loom.config.validate import resolve_model_args\n"
        "from torchtitan_loom.protocols import get_train_spec\n"
        "import torchtitan_loom.models\n"
        "out = {}\n"
        f"for name in {PRESETS!r}:\n"
        "    cfg = load_config(['--job.config_file', f'train_configs/{name}.toml'])\n"
        "    args = resolve_model_args(cfg)\n"
        "    with torch.device('meta'):\n"
        "        model = get_train_spec(cfg.model.name).model_cls(args)\n"
        "    t, o = cfg.training, cfg.optimizer\n"
        "    out[name] = dict(params=model.param_counts()['total'], H=model.num_loops, lr=o.lr, steps=t.steps,\n"
        "                     micro=t.micro_batch_size, rows=t.global_batch_size, seq=t.seq_len,\n"
        "                     K=t.bp_segment_len, eval=cfg.eval.interval)\n"
        "print(json.dumps(out))\n"
    )
    p = json.loads(ctx.runner.python(code).strip().splitlines()[-1])

    def size(n: int) -> str:
        return (
            f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"
        )

    def facts(name: str) -> str:
        c = p[name]
        return (
            f"{size(c['params'])} parameters at H = {c['H']}, lr {c['lr']:g}, {c['steps']:,} steps, "
            f"global batch {c['rows']} rows × {c['seq']} tokens, micro-batch {c['micro']}, K = {c['K']}, "
            f"eval every {c['eval']} steps"
        )

    return (
        "\n".join(
            prose(
                f"- `train_configs/{n}.toml`{' (the default)' if n == 'debug_model' else ''}: {facts(n)};",
                "  ",
            )
            for n in PRESETS
        )
        + "\n- `train_configs/loom_1p7b_float8.toml`: the 1.7B preset with float8."
    )


# ----- docs/parallelism.md


def _table(stdout: str) -> list[str]:
    """The last markdown table a benchmark printed (it prints rows as they finish, then the table)."""
    lines = stdout.rstrip("\n").split("\n")
    end = max(i for i, ln in enumerate(lines) if ln.startswith("|"))
    start = end
    while start > 0 and lines[start - 1].startswith("|"):
        start -= 1
    rows = lines[start : end + 1]
    header = rows.index(next(r for r in rows if r.startswith("|---")))
    return rows[header - 1 :]


def memory_time_table(ctx: Context) -> str:
    res = ctx.run(MEMORY_TIME)
    rows = _table(res.stdout)
    cells = {
        (r.split("|")[1].strip(), r.split("|")[2].strip()): r.split("|")[3:6] for r in rows[2:]
    }

    def ratio(k: str, mode: str) -> float:
        return float(cells[(k, mode)][2].strip().rstrip("×"))

    def step(k: str, mode: str) -> float:
        return float(cells[(k, mode)][0])

    ac = [ratio("3", m) for m in ("block", "loop")]
    slow = max(step("3", m) for m in ("block", "loop")) / step("3", "none")
    note = (
        f"K = 3 needs {ratio('3', 'none'):.2f}× the memory of full backprop; checkpointing per loop or per "
        f"block brings it to {min(ac):.2f}–{max(ac):.2f}× for up to {slow:.2f}× the step time."
    )
    return "```\n$ " + MEMORY_TIME + "\n```\n\n" + "\n".join(rows) + "\n\n" + prose(note)


def reshard_table(ctx: Context) -> str:
    res = ctx.run(RESHARD)
    return "```\n$ " + RESHARD + "\n```\n\n" + "\n".join(_table(res.stdout))


def dry_run_console(ctx: Context) -> str:
    res = ctx.run(DRY_RUN)
    lines = res.console.rstrip("\n").split("\n")
    head = [ln for ln in lines[:12] if not ln.startswith("  mesh ")][:3]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("estimate per rank"))
    wanted = (
        "estimate per rank",
        "gathered parameters",
        "unsharded gradient",
        "total",
        "step time:",
        "recommended:",
    )
    out, cut = head + ["..."], False
    for ln in lines[start:]:
        if ln.strip().startswith(wanted):
            out.append(ln)
            cut = False
        elif not cut:
            out.append("...")
            cut = True
    return block(res, "\n".join(out))


def _estimate(ctx: Context, extra: str) -> tuple[dict, str]:
    out = ctx.runner.run(f"{ESTIMATE} {extra}").console
    est = out[out.index("estimate per rank") :]
    step = re.search(r"-> ([\d.]+) s per step, MFU ([\d.]+)%", est)
    total = re.search(r"^\s+total\s+([\d.]+)", est, re.M)
    rec = re.search(
        r"recommended: --parallelism.dp_replicate (\d+) --parallelism.dp_shard (\d+) --parallelism.ep (\d+)",
        est,
    )
    layout = f"dp_replicate {rec[1]} × dp_shard {rec[2]}, ep {rec[3]}"
    best = re.search(re.escape(layout) + r": ([\d.]+) s per step, MFU ([\d.]+)%, ([\d.]+) GiB", est)
    short = layout.replace("dp_replicate 1 × ", "").replace(", ep 1", "")
    return dict(
        step=step[1],
        mfu=step[2],
        mem=f"{float(total[1]):.1f}",
        rec=short,
        rec_step=best[1],
        rec_mfu=best[2],
        rec_mem=best[3],
    ), est


def dry_run_estimates(ctx: Context) -> str:
    rows = [
        "| GPUs | layout = degrees (dp_shard = all) | step time | MFU | memory per rank "
        "| layout = auto (the preset's) | step time | MFU | memory per rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for world, extra in ((8, ""), (64, ""), (512, " --training.micro_batch_size 2")):
        e, _ = _estimate(
            ctx, f"--parallelism.dry_run_world_size {world}{extra} --parallelism.layout degrees"
        )
        same = e["rec"] == f"dp_shard {world}"
        rows.append(
            f"| {world} | dp_shard {world} | {e['step']} s | {e['mfu']}% | {e['mem']} GiB | "
            + ("the same" if same else e["rec"])
            + f" | {e['rec_step']} s | {e['rec_mfu']}% | {e['rec_mem']} GiB |"
        )
    _, est = _estimate(ctx, "--parallelism.dry_run_world_size 64")
    excerpt = est[: est.index("\n", est.index("  step time:"))]
    return (
        "```bash\n" + ESTIMATE_SHOWN + "\n```\n\n" + "\n".join(rows) + "\n\n"
        'The estimate at 64 GPUs with the preset\'s `layout = "auto"`, which chose the '
        "recommended layout:\n\n"
        "```\n" + excerpt + "\n```"
    )


# ----- docs/checkpoints.md


def checksum_cost(ctx: Context) -> str:
    code = (
        "import json, os, time, zlib\n"
        "from torchtitan_loom.components.checkpoint.integrity import crc32_file\n"
        "buf = os.urandom(256 << 20)\n"
        "t = time.perf_counter(); zlib.crc32(buf); mem = len(buf) / (time.perf_counter() - t)\n"
        f"path = {str(ctx.runner.work / 'crc.bin')!r}\n"
        "open(path, 'wb').write(buf)\n"
        "t = time.perf_counter(); crc32_file(path); disk = len(buf) / (time.perf_counter() - t)\n"
        "os.remove(path)\n"
        "print(json.dumps(dict(mem=mem, disk=disk)))\n"
    )
    speed = json.loads(ctx.runner.python(code).strip().splitlines()[-1])
    params = json.loads(
        ctx.runner.python(
            "import json, torch\nfrom torchtitan_loom.config import load_config\n"
            "from torchtitan_loom.config.validate import resolve_model_args\n"
            "from torchtitan_loom.protocols import get_train_spec\nimport torchtitan_loom.models\nout = {}\n"
            "for n in ('debug_model', 'loom_329m'):\n"
            "    cfg = load_config(['--job.config_file', f'train_configs/{n}.toml'])\n"
            "    with torch.device('meta'):\n"
            "        out[n] = get_train_spec(cfg.model.name).model_cls(resolve_model_args(cfg)).param_counts()['total']\n"
            "print(json.dumps(out))\n"
        )
        .strip()
        .splitlines()[-1]
    )
    state = {n: 12 * c for n, c in params.items()}  # fp32 weights + two AdamW moments per parameter
    lo, hi = (state["loom_329m"] / s for s in (speed["mem"], speed["disk"]))
    lo, hi = min(lo, hi), max(lo, hi)
    return prose(
        f"Checksum cost: CRC-32 from the standard library's `zlib` (no dependency) ran at "
        f"{speed['mem'] / 1e9:.2f} GB/s from memory and {speed['disk'] / 1e9:.2f} GB/s through "
        f"`integrity.crc32_file` on a 256 MiB file ({machine()}), once on save and once on load; for the "
        f"329m preset's {state['loom_329m'] / 1e9:.1f} GB of fp32 model and AdamW state that is roughly "
        f"{lo:.0f} to {hi:.0f} s per save and per load, for the debug model "
        f"({state['debug_model'] / 1e6:.0f} MB) {state['debug_model'] / speed['disk']:.2f} s."
    )


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


def moe_layer_by_op(ctx: Context) -> str:
    res = ctx.run(MOE_BY_OP)
    rows = _table(res.stdout)
    total = next(r for r in rows if "outside the GEMMs" in r).split("|")[2:-1]
    gemms = next(r for r in rows if "**GEMMs**" in r).split("|")[2:-1]
    note = (
        f"Outside its GEMMs the layer allocates {total[1].strip()} MiB with the plain compositions and "
        f"{total[4].strip()} MiB with the fused SwiGLU and combine (written, in-place and out= included: "
        f"{total[2].strip()} and {total[5].strip()} MiB); the GEMMs' {gemms[1].strip()} MiB do not change."
    )
    return "```\n$ " + MOE_BY_OP + "\n```\n\n" + "\n".join(rows) + "\n\n" + prose(note)


def diag_cost(ctx: Context) -> str:
    res = ctx.run(DIAG_COST)
    rows = _table(res.stdout)
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
    shutil.copyfile(out / "load_layer_0.png", ROOT / HEATMAP)
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
        f"![expert load, layer 0, default debug run](routing_heatmap_debug.png)"
    )


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
    row = _last_eval(ctx, "/tmp/loom_debug")
    return (
        block(res, "")
        + "\n\n"
        + prose(
            f"({duration(res.cpu_s)} of CPU time, {duration(res.wall_s)} of wall time, "
            f"{machine()}; eval loss after loop 1 / 2 / 3 at step {row['step']}: {_loop_losses(row)}.)"
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


PRODUCERS: dict[str, Producer] = {
    "default-run-console": Producer((DEFAULT_RUN,), default_run_console),
    "train-duration": Producer((), train_duration),
    "install-duration": Producer((), install_duration, needs="install"),
    "suite-duration": Producer((), suite_duration, needs="suite_log"),
    "preset-sizes": Producer((), preset_sizes),
    "dry-run-console": Producer((DRY_RUN,), dry_run_console),
    "dry-run-estimates": Producer((), dry_run_estimates),
    "reshard-table": Producer((RESHARD,), reshard_table),
    "memory-time-table": Producer((MEMORY_TIME,), memory_time_table),
    "checksum-cost": Producer((), checksum_cost),
    "metrics-size": Producer((METRICS_SIZE,), metrics_size),
    "diag-cost": Producer((DIAG_COST,), diag_cost),
    "moe-layer-by-op": Producer((MOE_BY_OP,), moe_layer_by_op),
    "analysis-tables": Producer((DEFAULT_RUN, ANALYZE), analysis_tables),
    "short-run": Producer((SHORT_RUN,), short_run),
    "generate-console": Producer((GENERATE,), generate_console),
    "lm-eval-console": Producer((LM_EVAL,), lm_eval_console),
    "hf-export-console": Producer((HF_EXPORT, HF_SNIPPET), hf_export_console),
}
