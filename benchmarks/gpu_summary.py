"""The summary file of benchmarks/gpu_check.sh, rewritten after every stage: stage table, one row
per cell with what a GPU engineer asks for first, the ratios against the goals, and the last log
lines of every stage that did not pass.

    python benchmarks/gpu_summary.py WORK_DIR OUT_FILE [--dry]

WORK_DIR holds `stages.tsv` (one line per finished stage: name, status, seconds, log file, note),
`plan.txt` (every stage of the run, in order), `env.txt`, `peak.json` (benchmarks/matmul_peak.py)
and `cells/<stage>.json` (benchmarks/throughput.py's record of that stage's cell).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cell_record import GOAL_COMPILE, GOAL_FLOAT8, GOAL_MFU_PCT, progress_note

TAIL_LINES = 30
CELLS = ("bf16_compiled", "bf16_eager", "float8_compiled", "float8_eager")


def read_stages(work: Path) -> list[dict[str, str]]:
    path = work / "stages.tsv"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, seconds, log, note = (line.split("\t") + [""] * 5)[:5]
        rows.append({"name": name, "status": status, "seconds": seconds, "log": log, "note": note})
    done = {r["name"] for r in rows}
    plan = work / "plan.txt"
    for name in plan.read_text().split() if plan.exists() else []:
        if name not in done:
            rows.append({"name": name, "status": "pending", "seconds": "", "log": "", "note": ""})
    return rows


def read_cell(work: Path, stage: str) -> dict[str, Any] | None:
    path = work / "cells" / f"{stage}.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    cells = record.get("cells") or [None]
    return {"meta": record.get("meta", {}), **(cells[0] or {"status": "no record"})}


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def tail(path: str, n: int = TAIL_LINES) -> list[str]:
    try:
        return Path(path).read_text(errors="replace").splitlines()[-n:]
    except OSError as exc:
        return [f"(no log: {exc})"]


def ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or a.get("status") != "ok" or b.get("status") != "ok":
        return None
    return a["tokens_per_s"] / b["tokens_per_s"] if b.get("tokens_per_s") else None


def verdict(value: float | None, goal: float) -> str:
    return "not measured" if value is None else ("met" if value >= goal else "NOT met")


def cell_rows(cells: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| cell | status | tokens/s | TFLOP/s | MFU % datasheet | MFU % measured peak "
        "| warm-up 1st step s | graphs (warm-up / recompiles timed) | step s min / median / max "
        "| peak alloc / reserved GiB | attention | experts | final loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for name, c in cells.items():
        ok = c.get("status") == "ok"
        status = "ok" if ok else f"{c.get('status')}: {c.get('reason', '')}".replace("|", "/")
        lines.append(
            f"| {name} | {status} | {_fmt(c.get('tokens_per_s'), ',.0f')} "
            f"| {_fmt(c.get('tflops'), '.1f')} | {_fmt(c.get('mfu'), '.1f')} "
            f"| {_fmt(c.get('mfu_measured_peak'), '.1f')} | {_fmt(c.get('warmup_first_step_s'), '.1f')} "
            f"| {_fmt(c.get('graphs_compiled_in_warmup'), 'd')} / {_fmt(c.get('recompiles_in_timed_steps'), 'd')} "
            f"| {_fmt(c.get('step_time_min_s'), '.3f')} / {_fmt(c.get('step_time_median_s'), '.3f')} "
            f"/ {_fmt(c.get('step_time_max_s'), '.3f')} "
            f"| {_fmt(c.get('peak_memory_gib'), '.2f')} / {_fmt(c.get('peak_reserved_gib'), '.2f')} "
            f"| {c.get('attention', '–')} | {c.get('expert_kernel', '–')} "
            f"| {_fmt(c.get('final_loss'), '.4f')} |"
        )
    return lines


def summary(work: Path, dry: bool) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    lines = [
        f"# GPU check, updated {stamp}"
        + (" (DRY RUN: CPU stand-ins, not measurements)" if dry else ""),
        "",
    ]
    env = work / "env.txt"
    if env.exists():
        lines += ["```", *env.read_text().strip().splitlines(), "```", ""]
    stages = read_stages(work)
    lines += ["| stage | status | seconds | note |", "|---|---|---:|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']} | {s['note']} |" for s in stages]
    peak_path = work / "peak.json"
    peak = json.loads(peak_path.read_text()) if peak_path.exists() else None
    if peak:
        lines += [
            "",
            f"Measured matmul peak: {peak['tflops']:.1f} TFLOP/s ({peak['dtype']} "
            f"{peak['size']}^3 GEMM on {peak['device']}{'; ' + peak['note'] if 'note' in peak else ''}).",
        ]
    cells = {n: c for n in CELLS if (c := read_cell(work, n)) is not None}
    if cells:
        meta = next(iter(cells.values()))["meta"]
        lines += [
            "",
            f"Cells: preset `{meta.get('preset')}`, H = {meta.get('num_loops', '?')}, global batch "
            f"{meta.get('global_batch_size')} x seq {meta.get('seq_len')} (micro-batch "
            f"{meta.get('micro_batch_size')}), {meta.get('steps')} timed steps after "
            f"{meta.get('warmup')} warm-up (the first holds the compilation), on "
            f"{meta.get('device_name')}; AC none. MFU against the dense bf16 datasheet peak and "
            "against the measured matmul peak, for float8 too (bf16-equivalent).",
            "",
            *cell_rows(cells),
        ]
        cut = [(n, progress_note(c)) for n, c in cells.items() if progress_note(c)]
        if cut:
            lines += ["", "Cells that did not finish, as far as they got:"]
            lines += [f"- {n}: {note}" for n, note in cut]
        bf16, eager, f8, f8_eager = (cells.get(n) for n in CELLS)
        mfu = bf16.get("mfu") if bf16 else None
        compile_ratio = ratio(bf16, eager)
        # float8 against bf16 compiled; when float8 ran eager (the bf16 compile did not fit), eager.
        f8_ratio, f8_how = (
            (ratio(f8, bf16), "compiled") if f8 else (ratio(f8_eager, eager), "eager")
        )
        lines += [
            "",
            "Against the goals:",
            f"- bf16 compiled MFU (datasheet): {_fmt(mfu, '.1f')} % (goal ≥ {GOAL_MFU_PCT:.0f} %: "
            f"{verdict(mfu, GOAL_MFU_PCT)}); against the measured peak "
            f"{_fmt(bf16.get('mfu_measured_peak') if bf16 else None, '.1f')} %",
            f"- float8 / bf16 tokens/s ({f8_how}): {_fmt(f8_ratio, '.2f')} (goal ≥ {GOAL_FLOAT8}: "
            f"{verdict(f8_ratio, GOAL_FLOAT8)})",
            f"- compiled / eager tokens/s (bf16): {_fmt(compile_ratio, '.2f')} (goal ≥ "
            f"{GOAL_COMPILE}: {verdict(compile_ratio, GOAL_COMPILE)})",
        ]
    for s in stages:
        if s["status"] in ("ok", "pending"):
            continue
        lines += [
            "",
            f"## {s['name']}: {s['status']}; last {TAIL_LINES} lines of its log (all of it in "
            "gpu_check.log)",
            "",
            "```",
            *tail(s["log"]),
            "```",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--dry", action="store_true")
    args = p.parse_args(argv)
    text = summary(args.work, args.dry)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
