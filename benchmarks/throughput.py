"""Training throughput of a preset for {bf16, float8 tensorwise, float8 rowwise} x {compile off, on}
x {activation checkpointing none, loop}: tokens/s, achieved TFLOP/s, MFU, peak memory.

Each cell builds the real Trainer in this process (config -> validate -> Trainer) and times
`Trainer.train_step` on a synthetic byte-level pack written once per sequence length, after
warm-up steps (compilation happens there). A cell whose config the trainer rejects is reported
"unsupported" with the validator's message (e.g. compile or AC before they land), a cell that
fails while running "error", and a cell past --time-budget-s "skipped". Results are rewritten
after every cell, so a crash keeps the cells before it:

    <out>/throughput_<preset>.json   meta + one record per cell
    <out>/throughput_<preset>.md     the Markdown table

    python benchmarks/throughput.py --preset loom_329m --steps 20 --out outputs/bench \\
        --training.global_batch_size 16 --training.micro_batch_size 8
    python benchmarks/throughput.py --cpu --preset debug --steps 5 --warmup 2 --out outputs/bench_cpu

Arguments after the options are config overrides (--section.key value), applied to every cell.
--cpu runs on the CPU with float8 emulated (correctness smoke test; emulation is slower than bf16).
Every cell is one process, so expert parallelism (EP > 1 needs that many ranks) is not measured
here; `--parallelism.dry_run` lays float8 experts under EP out on any machine.
FLOPs per token are the model's own count (`flops_per_token(seq_len, head_calls=segments)`), the
same for every precision; MFU is against the device's dense bf16 peak (null on CPU), also for
float8 cells, so float8 MFU reads as "bf16-equivalent".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan_loom.components.observability.metrics import memory_stats, peak_flops, throughput  # noqa: E402
from torchtitan_loom.config import ConfigError, load_config  # noqa: E402
from torchtitan_loom.config.validate import resolve  # noqa: E402
from torchtitan_loom.distributed.utils import DistInfo, pick_device  # noqa: E402
from torchtitan_loom.trainer import Trainer  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from cell_record import (  # noqa: E402
    compile_times_s,
    compiled_graphs,
    failure_reason,
    kernels,
    mfu_measured,
    progress_record,
    spread,
)
from step_profile import profile_steps  # noqa: E402
from throughput_report import PROFILE_STEPS, device_meta, format_shares, markdown  # noqa: E402

PRESET_FILES = {
    "debug": "debug_model.toml",
    "loom_329m": "loom_329m.toml",
    "loom_1p7b": "loom_1p7b.toml",
}
PRECISIONS = {
    "bf16": [],
    "float8_tensorwise": ["--float8.enable", "--float8.recipe", "tensorwise"],
    "float8_rowwise": ["--float8.enable", "--float8.recipe", "rowwise"],
}
COMPILE = {
    "off": ["--compile.enable", "false"],
    "on": ["--compile.enable", "true"],
}  # GPU presets compile
AC = {"none": [], "loop": ["--activation_checkpoint.mode", "loop"]}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Unknown --section.key value pairs are config overrides.",
    )
    p.add_argument("--preset", default="debug", choices=sorted(PRESET_FILES))
    p.add_argument("--steps", type=int, default=20, help="timed steps per cell")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps first (compilation happens here)"
    )
    p.add_argument(
        "--precisions", default=",".join(PRECISIONS), help=f"subset of {','.join(PRECISIONS)}"
    )
    p.add_argument("--compile", default="off,on", help="subset of off,on")
    p.add_argument("--ac", default="none,loop", help="subset of none,loop")
    p.add_argument(
        "--float8-experts",
        default="on",
        choices=("on", "off"),
        help="float8 cells also convert the routed experts (default on)",
    )
    p.add_argument("--cpu", action="store_true", help="run on CPU, float8 emulated")
    p.add_argument(
        "--time-budget-s", type=float, default=0.0, help="skip cells starting after this (0: none)"
    )
    p.add_argument("--out", default="outputs/bench", help="output folder")
    p.add_argument(
        "--hang-after-step",
        type=int,
        default=0,
        help="for the GPU check's own tests: each cell sleeps until it is killed after this many "
        "warm-up steps (0: never)",
    )
    p.add_argument(
        "--measured-peak-tflops",
        type=float,
        default=None,
        help="a bf16 matmul peak measured on this device (benchmarks/matmul_peak.py): each cell "
        "also reports MFU against it",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, profile 2 more steps per cell: Chrome trace "
        "<out>/traces/<cell>.json and the share of step time in GEMMs, attention, all-to-all, other",
    )
    args, overrides = p.parse_known_args(argv)
    for name, table in (("precisions", PRECISIONS), ("compile", COMPILE), ("ac", AC)):
        values = [v for v in getattr(args, name).split(",") if v]
        bad = [v for v in values if v not in table]
        if bad:
            p.error(f"--{name}: unknown {bad}; valid: {','.join(table)}")
        setattr(args, name, values)
    if any(not o.startswith("--") for o in overrides[:1]):
        p.error(
            f"unexpected argument {overrides[0]!r}; config overrides look like --section.key value"
        )
    return args, overrides


def public(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cells without their in-memory keys (cell_record.progress_record)."""
    return [{k: v for k, v in c.items() if not k.startswith("_")} for c in cells]


def has_override(overrides: list[str], key: str) -> bool:
    return any(o == f"--{key}" or o.startswith(f"--{key}=") for o in overrides)


def bench_pack(out: Path, seq_len: int, tokens_needed: int) -> Path:
    """A byte-level pack of the bundled generator's documents, records of seq_len+1 tokens."""
    from torchtitan_loom.components.data.pack_writer import PackWriter
    from torchtitan_loom.components.data.synthetic_corpus import generate_documents
    from torchtitan_loom.components.data.tokenizer import ByteTokenizer

    target = max(200_000, int(tokens_needed * 1.3))
    path = out / f"bench-pack-s{seq_len + 1}-{target}"
    if (path / "metadata.json").exists():
        return path
    tok = ByteTokenizer()
    info = {
        "vocab_size": tok.vocab_size,
        "name_or_path": tok.name_or_path,
        "eos_token_id": tok.eos_id,
    }
    with PackWriter(path, info, seq_len + 1) as w:
        for doc in generate_documents(seed=0, target_bytes=target):
            w.add_document(tok.encode_array(doc))
        w.finish(epochs=1, holdout_tokens=max(1, target // 100), seed=0)
    return path


def cell_argv(
    args: argparse.Namespace,
    overrides: list[str],
    precision: str,
    compile_: str,
    ac: str,
    dump: Path,
) -> list[str]:
    """The trainer argv of one cell: preset file, benchmark defaults, user overrides, cell flags."""
    argv = [
        "--job.config_file",
        str(ROOT / "train_configs" / PRESET_FILES[args.preset]),
        "--job.dump_folder",
        str(dump),
        "--metrics.enable_tensorboard",
        "false",
        "--eval.interval",
        "0",
        "--checkpoint.enable",
        "false",
        "--spike_guard.enable",
        "false",
        "--training.mixed_precision_param",
        "bfloat16",
        "--training.steps",
        str(args.warmup + args.steps + PROFILE_STEPS * args.profile),
    ]
    if args.cpu:
        argv += ["--training.device", "cpu"]
    argv += overrides + PRECISIONS[precision] + COMPILE[compile_] + AC[ac]
    if precision != "bf16":
        argv += ["--float8.experts", "true" if args.float8_experts == "on" else "false"]
        if args.cpu:
            argv += ["--float8.emulate", "true"]
    return argv


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_cell(
    argv: list[str],
    steps: int,
    warmup: int,
    trace: Path | None = None,
    measured_peak_tflops: float | None = None,
    progress: Callable[[dict[str, Any]], None] = lambda record: None,
    hang_after_step: int = 0,
) -> dict[str, Any]:
    """Train `warmup` + `steps` steps of the config `argv`; the record of the timed steps (with
    `trace`, then PROFILE_STEPS profiled steps: the trace file and the time shares). Every step is
    timed alone (synchronised): the first warm-up step holds the compilation, and a recompile
    inside the timed steps shows as a new graph and a slow step. `progress` gets the record so far
    when the trainer is built and after every step (benchmarks/cell_record.py: progress_record),
    so a cell cut by its caller still says how far it got."""
    try:
        cfg = load_config(argv)
        resolved = resolve(cfg, 1)
    except ConfigError as exc:
        return {"status": "unsupported", "reason": " / ".join(str(exc).splitlines())}
    device = pick_device(cfg.training.device)
    info = DistInfo(rank=0, world_size=1, device=device)
    trainer = None
    try:
        t_build = time.perf_counter()
        progress(progress_record("building the trainer", t_build))
        trainer = Trainer(cfg, resolved, info)
        build_s = time.perf_counter() - t_build
        chosen = kernels(trainer, device.type, cfg.compile.enable)
        batches, train_step = iter(trainer.dataloader), trainer.train_step
        graphs0 = compiled_graphs()
        warm_times: list[float] = []
        times: list[float] = []

        def timed_step(phase: str) -> tuple[float, float]:
            progress(
                progress_record(phase, time.perf_counter(), build_s, warm_times, times, graphs0)
            )
            _sync(device)
            t0 = time.perf_counter()
            loss = train_step(next(batches)).seg_losses[-1]
            _sync(device)
            return time.perf_counter() - t0, loss

        for k in range(warmup):
            warm_times.append(timed_step(f"warm-up step {k + 1}/{warmup}")[0])
            if k + 1 == hang_after_step:  # the GPU check's tests: a cell that never finishes
                now = time.perf_counter()
                progress(progress_record("hang", now, build_s, warm_times, times, graphs0))
                while True:
                    time.sleep(3600)
        graphs_warm = compiled_graphs()
        memory_stats(device)  # CUDA: resets the peak, so the record covers the timed steps only
        timed = []
        for k in range(steps):
            timed.append(timed_step(f"timed step {k + 1}/{steps}"))
            times.append(timed[-1][0])
        progress(
            progress_record("finishing", time.perf_counter(), build_s, warm_times, times, graphs0)
        )
        times, losses = [t for t, _ in timed], [loss for _, loss in timed]
        elapsed = sum(times)
        shares = None
        if trace is not None:
            shares = profile_steps(lambda: train_step(next(batches)), PROFILE_STEPS, trace, device)
        t = cfg.training
        # The trainer's own FLOP count and formula (observability/metrics.throughput), as logged.
        flops_per_token = trainer.parts.training.flops_per_token
        rate = throughput(
            steps * t.global_batch_size * t.seq_len, elapsed, flops_per_token, peak_flops(device)
        )
        mem = memory_stats(device)
        return {
            "status": "ok",
            **rate,
            "mfu_measured_peak": mfu_measured(rate.get("tflops"), measured_peak_tflops),
            "measured_peak_tflops": measured_peak_tflops,
            "peak_memory_gib": mem.get("memory_max_allocated_gib", mem.get("memory_max_rss_gib")),
            "peak_reserved_gib": mem.get("memory_max_reserved_gib"),
            "memory_kind": "cuda max allocated" if device.type == "cuda" else "process max RSS",
            "build_s": build_s,
            "compile_times_s": compile_times_s(),
            "warmup_first_step_s": warm_times[0] if warm_times else None,
            "warmup_step_times_s": warm_times,
            "graphs_compiled_in_warmup": graphs_warm - graphs0,
            "recompiles_in_timed_steps": compiled_graphs() - graphs_warm,
            "step_time_s": elapsed / steps,
            "step_times_s": times,
            **spread(times),
            **chosen,
            "flops_per_token": flops_per_token,
            "final_loss": losses[-1],
            "losses": losses,
            **({"profile": shares, "trace": str(trace)} if shares else {}),
        }
    except Exception as exc:  # a failing cell is a result, the matrix goes on
        traceback.print_exc()  # the whole of it, into the cell's log
        return {
            "status": "error",
            "reason": failure_reason(exc),
            "traceback": traceback.format_exc(),
        }
    finally:
        del trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if cfg.compile.enable:
            torch._dynamo.reset()


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        probe = load_config(
            [
                "--job.config_file",
                str(ROOT / "train_configs" / PRESET_FILES[args.preset]),
                *overrides,
            ]
        )
    except ConfigError as exc:  # an override every cell shares: no cell can run
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    t = probe.training
    if not has_override(overrides, "data.path"):
        need = (
            (args.warmup + args.steps + PROFILE_STEPS * args.profile)
            * t.global_batch_size
            * (t.seq_len + 1)
        )
        overrides = [*overrides, "--data.path", str(bench_pack(out, t.seq_len, need))]
    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = None
    meta = {
        "preset": args.preset,
        "steps": args.steps,
        "warmup": args.warmup,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "seq_len": t.seq_len,
        "num_loops": probe.model.num_loops,
        "overrides": overrides,
        "torch": torch.__version__,
        "torchao": torchao_version,
        "cpu_mode": args.cpu,
        "command": " ".join(
            ["python", "benchmarks/throughput.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "mfu_note": "MFU against the dense bf16 peak for every precision",
        **device_meta(args.cpu),
    }
    json_path, md_path = (
        out / f"throughput_{args.preset}.json",
        out / f"throughput_{args.preset}.md",
    )
    cells: list[dict[str, Any]] = []
    current: dict[str, Any] = {}  # the cell running now, as far as it got

    def write(extra: list[dict[str, Any]]) -> None:  # both files replaced whole
        for path, text in (
            (json_path, json.dumps({"meta": meta, "cells": public(cells + extra)}, indent=1)),
            (md_path, markdown(meta, public(cells + extra))),
        ):
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)

    def on_progress(record: dict[str, Any]) -> None:
        current.update(record)
        write([current])

    def on_term(signum: int, frame: Any) -> None:
        """Cut by the caller (timeout's SIGTERM): record how far the cell got, then exit at once."""
        if current:
            since = time.perf_counter() - current.get("_phase_started", time.perf_counter())
            graphs0 = current.get("_graphs0")
            current.update(
                status="timed out",
                reason=f"stopped by signal {signum} during {current.get('phase')}, "
                f"{since:.1f} s into it",
                compile_times_s=compile_times_s(),
                graphs_compiled=None if graphs0 is None else compiled_graphs() - graphs0,
            )
            write([current])
        print(f"[throughput] stopped by signal {signum}: record written to {json_path}", flush=True)
        os._exit(124)

    signal.signal(signal.SIGTERM, on_term)
    started = time.perf_counter()
    # Order: AC none before loop, compile off before on, so a time budget cuts the least telling cells.
    for ac in args.ac:
        for compile_ in args.compile:
            for precision in args.precisions:
                name = f"{precision}-compile_{compile_}-ac_{ac}"
                cell = {"precision": precision, "compile": compile_, "ac": ac}
                if args.time_budget_s and time.perf_counter() - started > args.time_budget_s:
                    cell.update(
                        status="skipped", reason=f"time budget {args.time_budget_s:.0f} s used"
                    )
                else:
                    print(f"[throughput] {args.preset} {name} ...", flush=True)
                    trace = out / "traces" / f"{args.preset}-{name}.json" if args.profile else None
                    current.clear()
                    current.update(cell)
                    cell.update(
                        run_cell(
                            cell_argv(
                                args, overrides, precision, compile_, ac, out / "cells" / name
                            ),
                            args.steps,
                            args.warmup,
                            trace,
                            args.measured_peak_tflops,
                            on_progress,
                            args.hang_after_step,
                        )
                    )
                    current.clear()
                result = (
                    f"{cell['tokens_per_s']:,.0f} tok/s"
                    if cell["status"] == "ok"
                    else cell.get("reason", "")
                )
                print(f"[throughput] {name}: {cell['status']} {result}", flush=True)
                if "profile" in cell:
                    print(
                        f"[throughput] {name} profile: {format_shares(cell['profile'])}; trace {cell['trace']}",
                        flush=True,
                    )
                cells.append(cell)
                write([])
    print(markdown(meta, cells))
    return 0 if all(c["status"] != "error" for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
