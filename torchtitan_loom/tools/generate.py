"""Sample text from a trained LOOM checkpoint (incremental decoding with a K/V cache).

    python -m torchtitan_loom.tools.generate CKPT --prompt "The cat" [--max-new-tokens 64]
        [--temperature 0.8 --top-k 50 --top-p 0.95 --seed 0 --loops H' --device cpu|cuda]
        [--exit kl|confidence|learned --exit-threshold X] [--beyond last|cycle]

CKPT: a run folder, a step-N checkpoint directory or an export folder. The tokenizer is the
training pack's (``--tokenizer`` must match it). ``--loops H'`` stops after loop H' (1..2H: fewer than the
trained H is early exit, more runs deeper loops whose routers follow ``--beyond``); ``--exit``
lets each new token stop at its own loop once the criterion falls below ``--exit-threshold``
(components/evaluation/adaptive_exit.py: 0 = fixed depth; ``--loops`` is then the deepest), and
the mean loops per token go to stderr, set against the fixed depth that the checkpoint's depth
report (tools.depth, when one was written to its default folder) names: fewer loops than H are
no saving by themselves. ``--temperature 0`` is greedy. Capacity dropping is off.
Bad input: one line, exit code 2.

Progress goes to stderr (stdout carries only the text): "generate: loading CKPT ..." is printed
before torch and the model code are imported (tens of seconds on a cold file system), and when the
load took over SLOW_S seconds, one more line before sampling starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from torchtitan_loom.components.runtime import exit_codes

# Nothing here imports torch: the first line is printed before that wait (see run()).
from torchtitan_loom.components.runtime.messages import shorten_line
from torchtitan_loom.tools.exit_option import check_exit_flags, exit_rule
from torchtitan_loom.tools.input_files import BEYOND_HELP, LoadError

SLOW_S = 5.0  # a load slower than this is followed by a line saying what comes next


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_loom.tools.generate", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("ckpt", help="run folder, step-N checkpoint directory or export folder")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="tokens to sample (stops at EOS or max_seq_len)",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus: smallest set with this much mass; 1 = off",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--loops", type=int, default=None, help="stop after loop H' (1..2H); default H")
    p.add_argument(
        "--beyond",
        default=None,
        help=BEYOND_HELP,
    )
    p.add_argument(
        "--exit",
        default=None,
        help="per-token exit criterion: kl (successive loops' predictions), confidence "
        "(1 - top probability) or learned (the model's exit head: the predicted loss drop of its next "
        "loops, in nats, asked at the run's backprop segment ends); "
        "default: every token runs --loops",
    )
    p.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="exit once the criterion is below this (kl and learned ≥ 0, confidence in [0, 1]; "
        "0 = fixed depth)",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model runs")
    p.add_argument(
        "--tokenizer", default=None, help="override the pack's tokenizer (must match it)"
    )
    return p


def run(ns: argparse.Namespace) -> str:
    """The generated continuation (without the prompt)."""
    start = time.monotonic()
    # stderr: stdout carries only the text
    print(f"generate: loading {ns.ckpt} ...", file=sys.stderr, flush=True)
    import torch

    from torchtitan_loom.components.evaluation.sampling import DepthUsed, SamplingConfig, generate
    from torchtitan_loom.tools.loading import check_loops, load

    check_exit_flags(ns.exit, ns.exit_threshold)
    cfg = SamplingConfig(
        max_new_tokens=ns.max_new_tokens,
        temperature=ns.temperature,
        top_k=ns.top_k,
        top_p=ns.top_p,
        seed=ns.seed,
        exit_criterion=ns.exit,
        exit_threshold=0.0 if ns.exit_threshold is None else ns.exit_threshold,
    )
    problems = cfg.problems()
    if problems:
        raise LoadError(problems[0])
    if ns.temperature == 0 and (ns.top_k, ns.top_p) != (0, 1.0):
        raise LoadError(
            "--top-k and --top-p filter what is sampled, and --temperature 0 samples nothing "
            "(greedy): leave them out, or pass --temperature above 0"
        )
    if ns.device == "cuda" and not torch.cuda.is_available():
        raise LoadError("--device cuda: no CUDA device is available here; use --device cpu")
    loaded = load(ns.ckpt, device=ns.device, tokenizer=ns.tokenizer)
    loops = check_loops(ns.loops, loaded.model, ns.beyond)
    rule = exit_rule(ns.exit, ns.exit_threshold, loaded, loops)
    if rule is not None:  # the learned head decides at its run's segment ends only
        cfg = dataclasses.replace(cfg, exit_loops=rule.decide_at)
    tok = loaded.tokenizer
    assert tok is not None  # load() builds one (need_tokenizer defaults to True)
    ids = tok.encode(ns.prompt)
    if not ids:
        raise LoadError("--prompt is empty: give at least one token of text")
    max_len = loaded.args.max_seq_len
    if len(ids) >= max_len:
        raise LoadError(
            f"--prompt is {len(ids)} tokens; the model takes at most max_seq_len={max_len} "
            f"positions, so a prompt may have at most {max_len - 1}"
        )
    if time.monotonic() - start > SLOW_S:
        print(
            f"generate: step {loaded.step} loaded in {time.monotonic() - start:.0f} s; sampling up "
            f"to {cfg.max_new_tokens} tokens ...",
            file=sys.stderr,
            flush=True,
        )
    prompt_BS = torch.tensor([ids], dtype=torch.long, device=ns.device)
    used = DepthUsed()
    new_BS = generate(loaded.model, prompt_BS, cfg, loops=loops, eos_id=tok.eos_id, depth_used=used)
    if cfg.exit_criterion is not None:
        from torchtitan_loom.tools.analyze_run import default_out
        from torchtitan_loom.tools.depth_run import DEPTH_DIR
        from torchtitan_loom.tools.depth_verdict import decoding_summary, saved_report

        run = {"job": {"dump_folder": loaded.config.job.dump_folder}} if loaded.config else {}
        folder, _ = default_out(loaded.checkpoint, run, loaded.step, DEPTH_DIR)
        print(
            decoding_summary(
                used.mean(),
                loops,
                cfg.exit_criterion,
                cfg.exit_threshold,
                len(used.loops_per_token),
                saved_report(folder),
            ),
            file=sys.stderr,
        )
    new = [t for t in new_BS[0].tolist() if t != tok.eos_id]
    return tok.decode(new)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        text = run(ns)
    except LoadError as exc:
        print(shorten_line(f"generate error: {exc}"), file=sys.stderr)
        return exit_codes.BAD_INPUT
    print(ns.prompt + text)
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
