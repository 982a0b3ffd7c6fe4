"""Producers of the regions that describe sizes, layouts and costs: the presets' sizes, the dry run
and its estimates, the FSDP benchmark tables, the checksum cost, and the figures the estimate and
the cost model give about a layout (communication volume, memory, capacity slots)."""

from __future__ import annotations

import datetime
import json
import re

from docs_context import (
    DRY_RUN,
    ESTIMATE,
    ESTIMATE_SHOWN,
    MEMORY_TIME,
    MOE_BY_OP,
    PRESETS,
    RESHARD,
    Context,
    block,
    last_table,
    prose,
)
from docs_runner import machine

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


def memory_time_table(ctx: Context) -> str:
    res = ctx.run(MEMORY_TIME)
    rows = last_table(res.stdout)
    cells = {
        (r.split("|")[1].strip(), r.split("|")[2].strip()): r.split("|")[3:6] for r in rows[2:]
    }

    def ratio(k: str, mode: str) -> float:
        return float(cells[(k, mode)][2].strip().rstrip("×"))

    def step(k: str, mode: str) -> float:
        return float(cells[(k, mode)][0])

    ac = [ratio("3", m) for m in ("block", "loop")]
    slow = max(step("3", m) for m in ("block", "loop")) / step("3", "none")
    errors = [int(re.search(r"\(([+-]?\d+)%\)", r)[1]) for r in rows[2:]]
    note = (
        f"K = 3 needs {ratio('3', 'none'):.2f}× the memory of full backprop; checkpointing per loop or per "
        f"block brings it to {min(ac):.2f}–{max(ac):.2f}× for up to {slow:.2f}× the step time. The dry "
        f"run's estimate is {min(errors):+d}% … {max(errors):+d}% off the measured peak."
    )
    return "```\n$ " + MEMORY_TIME + "\n```\n\n" + "\n".join(rows) + "\n\n" + prose(note)


def reshard_table(ctx: Context) -> str:
    res = ctx.run(RESHARD)
    caption = (
        f"Measured {datetime.date.today().isoformat()} ({machine()}, other jobs on the cores):"
    )
    return "```\n$ " + RESHARD + "\n```\n\n" + caption + "\n\n" + "\n".join(last_table(res.stdout))


def dry_run_console(ctx: Context) -> str:
    res = ctx.run(DRY_RUN)
    lines = res.console.rstrip("\n").split("\n")
    importing = lines[0].startswith("[torchtitan_loom] importing")  # the notice before the imports
    head = [ln for ln in lines[:12] if not ln.startswith("  mesh ")][: 3 + importing]
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


def moe_layer_by_op(ctx: Context) -> str:
    res = ctx.run(MOE_BY_OP)
    rows = last_table(res.stdout)
    total = next(r for r in rows if "outside the GEMMs" in r).split("|")[2:-1]
    gemms = next(r for r in rows if "**GEMMs**" in r).split("|")[2:-1]
    note = (
        f"Outside its GEMMs the layer allocates {total[1].strip()} MiB with the plain compositions and "
        f"{total[4].strip()} MiB with the fused SwiGLU and combine (written, in-place and out= included: "
        f"{total[2].strip()} and {total[5].strip()} MiB); the GEMMs' {gemms[1].strip()} MiB do not change."
    )
    return "```\n$ " + MOE_BY_OP + "\n```\n\n" + "\n".join(rows) + "\n\n" + prose(note)
