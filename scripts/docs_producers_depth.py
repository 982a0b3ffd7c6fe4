"""Producers of docs/studying_depth.md: the depth study (tools.study, then tools.compare on it), the
depth report of its H = 3 run and of its depth-trained run (tools.depth), and adaptive decoding
(tools.generate --exit). The study trains 27 runs one after another (over an hour on one core);
it writes under outputs/studies/ of the repository, as it does for a reader, so a refresh after a
finished study reuses its runs (the study skips finished runs) and only compares and reports.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from docs_context import Context, prose
from docs_runner import ROOT, Result, duration, machine
from docs_tour_figures import cpu_kind

STUDY_FOLDER = "outputs/studies/depth_debug"
STUDY = "python -m torchtitan_loom.tools.study train_configs/studies/depth_debug.toml"
COMPARE = (
    f"python -m torchtitan_loom.tools.compare {STUDY_FOLDER} --out /tmp/loom_depth_compare --force"
)
# No --tokens: the report reads what each run's held-out eval read (its eval.tokens), so its loss
# after H loops is the study's logged eval loss of that run.
DEPTH_H3 = (
    f"python -m torchtitan_loom.tools.depth {STUDY_FOLDER}/H3/seed-0 "
    "--out /tmp/loom_depth_H3 --force"
)
DEPTH_SAMPLED = (
    f"python -m torchtitan_loom.tools.depth {STUDY_FOLDER}/H3_depth_sampled/seed-0 "
    "--out /tmp/loom_depth_sampled --force"
)
GENERATE_EXIT = (
    f'python -m torchtitan_loom.tools.generate {STUDY_FOLDER}/H3/seed-0 --prompt "variables:\n'
    'q=9; z=q*2; h=z-7;" --max-new-tokens 40 --temperature 0 --exit kl --exit-threshold 0.1'
)
FIGURES = {  # the study's and the report's figures, copied next to the page
    "loss_vs_tokens.png": "docs/depth_study_loss_vs_tokens.png",
    "loss_vs_flops.png": "docs/depth_study_loss_vs_flops.png",
}
REPORT_FIGURE = "docs/depth_report_H3.png"
STUDY_TIMEOUT_S = 6 * 3600


def _study(ctx: Context) -> Result:
    return ctx.once(STUDY, lambda: ctx.runner.run(STUDY, timeout_s=STUDY_TIMEOUT_S))


def shell(command: str, body: str = "") -> str:
    """A console block: the command after '$ ', then what it printed (docs_producers_exit too)."""
    return "```\n$ " + command + ("\n" + body.rstrip("\n") if body.strip() else "") + "\n```"


def _compare(ctx: Context) -> tuple[Result, dict]:
    _study(ctx)
    res = ctx.run(COMPARE)
    out = Path(ctx.runner.real("/tmp/loom_depth_compare"))
    for name, dest in FIGURES.items():
        shutil.copyfile(out / name, ROOT / dest)
    return res, json.loads((out / "compare.json").read_text())


def _groups(numbers: dict) -> dict[str, dict]:
    return {g["name"]: g for g in numbers["groups"]}


def study_table(ctx: Context) -> str:
    study = _study(ctx)
    res, numbers = _compare(ctx)
    table = res.stdout.split("\n\nwritten:")[0]
    table = "\n".join(ln for ln in table.splitlines() if ln.startswith("|"))
    walls = [r["wall_s"] for r in numbers["runs"] if r.get("wall_s")]
    return (
        shell(STUDY, "")
        + "\n\n"
        + shell(COMPARE, "")
        + "\n\n"
        + table
        + "\n\n"
        + prose(
            f"Mean ± sample standard deviation over the seeds; losses are the held-out loss after "
            f"each loop at step 120. The second table is what each variant changes against the "
            f"first, read from each run's own run.json (the configuration it resolved). The "
            f"{len(walls)} runs took {duration(sum(walls))} of wall time summed over the runs, on "
            f"{cpu_kind()} ({machine()}); a rerun of the study command skips them "
            f"({duration(study.wall_s)} here)."
        )
    )


def _depth(ctx: Context, command: str, out: str) -> tuple[Result, dict]:
    _study(ctx)
    res = ctx.run(command)
    return res, json.loads((Path(ctx.runner.real(out)) / "depth.json").read_text())


def _tables(res: Result) -> str:
    lines = res.stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| loops"))
    return "\n".join(ln for ln in lines[start:] if not ln.startswith("report written"))


def depth_report(ctx: Context) -> str:
    res, numbers = _depth(ctx, DEPTH_H3, "/tmp/loom_depth_H3")
    shutil.copyfile(Path(ctx.runner.real("/tmp/loom_depth_H3")) / "depth.png", ROOT / REPORT_FIGURE)
    return shell(DEPTH_H3, _tables(res)) + f"\n\n({duration(res.wall_s)} on {machine()}.)"


def depth_training(ctx: Context) -> str:
    res, sampled = _depth(ctx, DEPTH_SAMPLED, "/tmp/loom_depth_sampled")
    _, fixed = _depth(ctx, DEPTH_H3, "/tmp/loom_depth_H3")
    _, numbers = _compare(ctx)
    groups = _groups(numbers)

    def final(name: str, loop: int) -> str:
        cell = groups[name]["final_loss_per_loop"][loop - 1]
        return f"{cell['mean']:.4f} ± {cell['std']:.4f}"

    def beyond(report: dict) -> str:
        rows = report["fixed"][report["better_beyond"] or "last"]
        return " / ".join(f"{r['loss']:.4f}" for r in rows[3:])

    return (
        shell(DEPTH_SAMPLED, _tables(res))
        + "\n\n"
        + prose(
            "On the same tokens (three seeds each), the held-out loss after loop 1 / 2 / 3 is "
            f"{final('H3', 1)} / {final('H3', 2)} / {final('H3', 3)} with fixed H = 3 and "
            f"{final('H3_depth_sampled', 1)} / {final('H3_depth_sampled', 2)} / "
            f"{final('H3_depth_sampled', 3)} with depth sampling. Past the trained depth (loops "
            f"4 / 5 / 6, seed 0, each run's better policy): {beyond(fixed)} fixed, "
            f"{beyond(sampled)} depth-sampled. Adaptive exit, fixed: {fixed['verdict']['text']}; "
            f"depth-sampled: {sampled['verdict']['text']}."
        )
    )


def generate_exit(ctx: Context) -> str:
    _study(ctx)
    res = ctx.run(GENERATE_EXIT)
    err = [ln for ln in res.stderr.splitlines() if "loops per token" in ln]
    return shell(GENERATE_EXIT, res.stdout + "\n".join(err))
