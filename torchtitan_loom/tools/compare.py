"""Compare run folders: one table per group of seeds, one row per run, two figures.

    python -m torchtitan_loom.tools.compare RUN_OR_STUDY [RUN_OR_STUDY ...] [--out DIR] [--force]

Each argument is a run folder (run.json + metrics.jsonl, as the trainer writes it) or a study
folder of tools.study (study.json: its runs, grouped by variant). Plain run folders group by
config: those whose config.toml differ only in training.seed and job.dump_folder are one group,
named by the keys the groups differ in. A group's row: runs (seeds), params, active params,
FLOPs/token, tokens, train time, wall time, the final held-out loss after each loop and the last
downstream task scores, as mean ± sample standard deviation over its finished runs
(tools/compare_runs.py says where each number comes from). The console gets the group table.

Files, in ``--out`` (default ``<study folder>/compare/`` for one study, else
``<parent of the first run folder>/compare/``, never the current directory): compare.md (tables
and figures), compare.json (every number, each run's eval curve), loss_vs_tokens.png and
loss_vs_flops.png (tools/compare_report.py). An occupied out folder is refused unless
``--force``, which replaces only those names; a symbolic link at one is refused, and so is a
default folder that is a link (out_files.py).
A damaged metrics.jsonl line is skipped with one warning naming the file and line. Errors: one
``compare error:`` line, exit 2. Progress: one line per phase (torch is imported only to count
the parameters, after the first line).
"""

from __future__ import annotations

import argparse
import os
import sys

from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.runtime.messages import count, shorten_line
from torchtitan_loom.tools.compare_runs import STUDY_JSON, CompareError
from torchtitan_loom.tools.progress import Progress


def default_out(paths: list[str], first_run: str) -> str:
    """``<study>/compare`` for one study folder, else ``<parent of the first run>/compare``."""
    if len(paths) == 1 and os.path.isfile(os.path.join(paths[0], STUDY_JSON)):
        return os.path.join(paths[0], "compare")
    return os.path.join(os.path.dirname(os.path.abspath(first_run)), "compare")


def compare(paths: list[str], out: str | None, force: bool, progress: Progress) -> str:
    """Read, group and write; returns the console table. CompareError for bad input."""
    from torchtitan_loom.tools.compare_diff import same_losses
    from torchtitan_loom.tools.compare_report import NAMES, write_outputs
    from torchtitan_loom.tools.compare_runs import find_runs, group_runs, model_sizes, summarize
    from torchtitan_loom.tools.out_files import check_out, clear_out, make_out

    def warn(msg: str) -> None:
        print(shorten_line(f"warning: {msg}"), file=sys.stderr, flush=True)

    notes: list[str] = []
    refs = find_runs(paths, notes)
    for note in notes:  # a run left out is said where the user looks, not only in compare.md
        warn(note)
    if not refs:
        raise CompareError(f"{', '.join(paths)}: no run folder to compare (a study not run yet?)")
    owner = out  # --out is the user's folder: a link there is theirs (out_files.py)
    out = out or default_out(paths, refs[0].path)
    owner = owner or os.path.dirname(out)  # the default: below the study or beside the runs
    check_out(out, force, NAMES, CompareError, owner)  # before the reading: fails fast
    progress.phase(f"reading {count(len(refs), 'run folder')}")
    runs = [summarize(ref, warn) for ref in refs]
    progress.phase("counting the models' parameters (built on the meta device)")
    model_sizes(runs, warn)
    groups = group_runs(runs)
    for alike in same_losses(groups):  # a row that differs from another by name only
        warn(alike)
        notes.append(alike)
    for g in groups:
        left = [r for r in g.runs if r.status != "finished"]
        notes += [f"{r.path}: {r.status} at step {r.step}, not in {g.name}'s numbers" for r in left]
    progress.phase(f"writing the tables and figures to {out}")
    clear_out(out, force, NAMES, CompareError, owner)
    make_out(out, CompareError, owner)
    table = write_outputs(out, paths, groups, runs, notes)
    return table + f"\n\nwritten: {os.path.join(out, 'compare.md')} (and compare.json, figures)"


def main(argv: list[str] | None = None) -> int:
    """The command line; 0, or 2 with one ``compare error:`` line."""
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_loom.tools.compare",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument("paths", nargs="+", metavar="RUN_OR_STUDY", help="run or study folders")
    parser.add_argument(
        "--out", default=None, help="output folder (default: <study>/compare or <parent>/compare)"
    )
    parser.add_argument("--force", action="store_true", help="replace an earlier comparison there")
    ns = parser.parse_args(argv)
    progress = Progress("compare")
    progress.phase(f"comparing {', '.join(ns.paths)}")
    try:
        print(compare(ns.paths, ns.out, ns.force, progress), flush=True)
    except (CompareError, OSError) as exc:  # OSError: a link refused, a full disk
        print(shorten_line(f"compare error: {exc}"), file=sys.stderr)
        return exit_codes.BAD_INPUT
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
