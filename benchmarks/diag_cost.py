"""Cost of the branch diagnostics: step time with them off and with each switch on, side by side in
ONE run, alternating step by step (the order rotates every round), on one Trainer.

    python benchmarks/diag_cost.py --cpu --preset debug --rounds 12 --out outputs/diag_cost
    python benchmarks/diag_cost.py --preset loom_329m --rounds 10 --out outputs/diag_cost \\
        --training.global_batch_size 16 --training.micro_batch_size 8

Variants: ``off``; ``activations`` (norm, var); ``rank`` (activations + the rank-collapse trio);
``all`` (+ per-submodule gradient norms). Per variant: the median step time; what its switch
adds over the variant before it (the cost of that diagnostic); the extra time of a
diagnostic step over ``off``; and that extra time spread over ``--interval`` steps, as a share of
the ``off`` step time (the cost a run pays at that diag_interval; the LOOM presets use 50).
Each step ends with the trainer's own host syncs, so wall time covers the device work. On the CPU
the default clock is the process's CPU time (single-threaded with OMP_NUM_THREADS=1), which other
programs on a shared machine do not inflate.

Outputs: ``<out>/diag_cost_<preset>.json`` and ``.md``. Arguments after the options are config
overrides (--section.key value).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import PRESET_FILES, bench_pack, device_meta, has_override  # noqa: E402

from torchtitan_loom.components.observability.diagnostics import build_diagnostics  # noqa: E402
from torchtitan_loom.config import load_config  # noqa: E402
from torchtitan_loom.config.validate import resolve  # noqa: E402
from torchtitan_loom.distributed.utils import DistInfo, pick_device  # noqa: E402
from torchtitan_loom.trainer import Trainer  # noqa: E402

VARIANTS = {  # (diag_activations, diag_rank, diag_grad); None = diagnostics off
    "off": None,
    "activations": (True, False, False),
    "rank": (True, True, False),
    "all": (True, True, True),
}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="debug", choices=sorted(PRESET_FILES))
    p.add_argument(
        "--rounds", type=int, default=12, help="timed rounds (each runs every variant once)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument(
        "--interval", type=int, default=50, help="diag_interval the overhead is spread over"
    )
    p.add_argument("--cpu", action="store_true", help="run on the CPU")
    p.add_argument(
        "--clock",
        default=None,
        choices=("wall", "process"),
        help="step timer: wall time, or this process's CPU time (default: process on the CPU, where "
        "other programs on a shared machine would swamp wall time; wall on a GPU)",
    )
    p.add_argument("--out", default="outputs/diag_cost", help="output folder")
    return p.parse_known_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"Diagnostics cost, {meta['preset']} on {meta['device_name']} ({meta['rounds']} alternating rounds, "
        f"{meta['clock']} time; "
        f"`{meta['command']}`)",
        "",
        f"| variant | keys | median step s | added by this switch s | extra per diagnostic step s | "
        f"extra at diag_interval {meta['interval']} |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['keys']} | {r['median_s']:.4f} | {r['added_s']:+.4f} | {r['extra_s']:+.4f} | "
            f"{r['share_at_interval']:+.2%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args, overrides = parse_args(raw)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    argv_cfg = [
        "--job.config_file",
        str(ROOT / "train_configs" / PRESET_FILES[args.preset]),
        "--job.dump_folder",
        str(out / "run"),
        "--metrics.enable_tensorboard",
        "false",
        "--eval.interval",
        "0",
        "--checkpoint.enable",
        "false",
        "--spike_guard.enable",
        "false",
        "--training.steps",
        str(10**6),
    ]
    if args.cpu:
        argv_cfg += ["--training.device", "cpu"]
    probe = load_config(argv_cfg + overrides)
    t = probe.training
    if not has_override(overrides, "data.path"):
        steps = (args.warmup + args.rounds) * len(VARIANTS)
        overrides = [
            *overrides,
            "--data.path",
            str(bench_pack(out, t.seq_len, steps * t.global_batch_size * (t.seq_len + 1))),
        ]
    cfg = load_config(argv_cfg + overrides)
    device = pick_device(cfg.training.device)
    trainer = Trainer(cfg, resolve(cfg, 1), DistInfo(rank=0, world_size=1, device=device))
    diagnostics = {}
    for name, switches in VARIANTS.items():
        acts, rank, grad = switches or (False, False, False)
        m = dataclasses.replace(
            cfg.metrics,
            diag_interval=1 if switches else 0,
            diag_activations=acts,
            diag_rank=rank,
            diag_grad=grad,
        )
        diagnostics[name] = build_diagnostics(m, trainer.model, len(trainer.segments), device)
    clock = args.clock or ("wall" if device.type == "cuda" else "process")
    now = time.perf_counter if clock == "wall" else time.process_time
    batches = iter(trainer.dataloader)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for r in range(args.warmup + args.rounds):
        order = (
            names[r % len(names) :] + names[: r % len(names)]
        )  # rotate: no variant always runs first
        for name in order:
            trainer.parts.step.parts.diagnostics = diagnostics[name]  # the part the step reads
            _sync(device)
            start = now()
            result = trainer.train_step(next(batches))
            _sync(device)
            if r >= args.warmup:
                times[name].append(now() - start)
            assert (result.diag is None) == (VARIANTS[name] is None)
        print(f"[diag_cost] round {r + 1}/{args.warmup + args.rounds}", flush=True)
    base = statistics.median(times["off"])
    rows, previous = [], base
    for name in names:
        median = statistics.median(times[name])
        extra = median - base
        rows.append(
            {
                "variant": name,
                "median_s": median,
                "extra_s": extra,
                "added_s": median - previous,
                "share_at_interval": extra / args.interval / base,
                "times_s": times[name],
                "keys": len(diagnostics[name].keys()) if VARIANTS[name] else 0,
            }
        )
        previous = median
    meta = {
        "preset": args.preset,
        "rounds": args.rounds,
        "clock": clock,
        "warmup": args.warmup,
        "interval": args.interval,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "seq_len": t.seq_len,
        "overrides": overrides,
        "torch": torch.__version__,
        **device_meta(args.cpu),
        "command": " ".join(["python", "benchmarks/diag_cost.py", *raw]),
    }
    (out / f"diag_cost_{args.preset}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    text = markdown(meta, rows)
    (out / f"diag_cost_{args.preset}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
