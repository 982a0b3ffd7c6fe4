"""The summary file of benchmarks/gpu_check.sh: stage table, throughput table, ratios, and the
log tail of the stage that failed.

    python benchmarks/gpu_summary.py WORK_DIR OUT_FILE [--dry]

WORK_DIR holds `stages.tsv` (one line per stage: name, status, seconds, log file, note),
`env.txt`, and `cells/<stage>.json` (benchmarks/throughput.py's record of that stage's cell).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

TAIL_LINES = 40
# The goals the cells are read against (loom_1p7b at H = 9).
GOAL_MFU_BF16, GOAL_FLOAT8, GOAL_COMPILE = 50.0, 1.3, 1.2


def read_stages(work: Path) -> list[dict[str, str]]:
    path = work / "stages.tsv"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        name, status, seconds, log, note = (line.split("\t") + [""] * 5)[:5]
        rows.append({"name": name, "status": status, "seconds": seconds, "log": log, "note": note})
    return rows


def read_cell(work: Path, stage: str) -> dict[str, Any] | None:
    path = work / "cells" / f"{stage}.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    cells = record.get("cells") or [None]
    return {"meta": record.get("meta", {}), **(cells[0] or {})}


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


def summary(work: Path, dry: bool) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    lines = [
        f"# GPU check {stamp}" + (" (DRY RUN: CPU stand-ins, not measurements)" if dry else ""),
        "",
    ]
    env = work / "env.txt"
    if env.exists():
        lines += ["```", *env.read_text().strip().splitlines(), "```", ""]
    stages = read_stages(work)
    lines += ["| stage | status | seconds | note |", "|---|---|---:|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']} | {s['note']} |" for s in stages]
    cells = {s["name"]: read_cell(work, s["name"]) for s in stages}
    cells = {k: v for k, v in cells.items() if v is not None}
    if cells:
        meta = next(iter(cells.values()))["meta"]
        lines += [
            "",
            f"Throughput: preset `{meta.get('preset')}`, H = {meta.get('num_loops', '?')}, global batch "
            f"{meta.get('global_batch_size')} x seq {meta.get('seq_len')} (micro-batch "
            f"{meta.get('micro_batch_size')}), {meta.get('steps')} timed steps after {meta.get('warmup')} "
            f"warm-up, on {meta.get('device_name')}; AC none.",
            "",
            "| cell | status | tokens/s | TFLOP/s | MFU % | peak mem GiB | step s | final loss |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, c in cells.items():
            status = (
                c.get("status", "?")
                if c.get("status") == "ok"
                else f"{c.get('status')}: {c.get('reason', '')}"
            )
            lines.append(
                f"| {name} | {status} | {_fmt(c.get('tokens_per_s'), ',.0f')} | {_fmt(c.get('tflops'), '.1f')} "
                f"| {_fmt(c.get('mfu'), '.1f')} | {_fmt(c.get('peak_memory_gib'), '.2f')} "
                f"| {_fmt(c.get('step_time_s'), '.3f')} | {_fmt(c.get('final_loss'), '.4f')} |"
            )
        bf16, f8, eager = (
            cells.get("bf16_compiled"),
            cells.get("float8_compiled"),
            cells.get("bf16_eager"),
        )
        mfu = bf16.get("mfu") if bf16 else None
        lines += [
            "",
            "Against the goals:",
            f"- bf16 compiled MFU: {_fmt(mfu, '.1f')} % (goal ≥ {GOAL_MFU_BF16:.0f} %)",
            f"- float8 / bf16 tokens/s (compiled): {_fmt(ratio(f8, bf16), '.2f')} (goal ≥ {GOAL_FLOAT8})",
            f"- compiled / eager tokens/s (bf16): {_fmt(ratio(bf16, eager), '.2f')} (goal ≥ {GOAL_COMPILE})",
        ]
    failed = [s for s in stages if s["status"] not in ("ok", "not run")]
    if failed:
        s = failed[0]
        lines += [
            "",
            f"## Failed stage: {s['name']} ({s['status']}); last {TAIL_LINES} lines of its log",
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
