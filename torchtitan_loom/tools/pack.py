"""Packer CLI: corpus files → packed-document pack (LOOM_SPEC §8.1); `--verify DIR` checks one.

    python -m torchtitan_loom.tools.pack --jsonl 'data/*.jsonl' --tokenizer byte --out packs/mine
    python -m torchtitan_loom.tools.pack --hf-dataset HuggingFaceFW/fineweb-edu --hf-config sample-10BT \
        --streaming --tokenizer path/to/tokenizer.json --out packs/fineweb-edu
    python -m torchtitan_loom.tools.pack --verify packs/mine

Documents are read in input order (all --jsonl files, then --text, then --parquet, each list in
the order given with globs sorted, then the --hf-dataset rows in dataset order), tokenised in parallel by --workers processes (results are
consumed in order, so the pack does not depend on the number of workers), EOS-terminated and
chunked into records of --seq-len tokens. This module is the command line; the inputs are read by
pack_sources.py, the tokenizing, writing and --verify are pack_build.py's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from torchtitan_loom.components.data.pack_format import PackError
from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.runtime.messages import shorten_line
from torchtitan_loom.tools.pack_build import run_pack, verify
from torchtitan_loom.tools.pack_sources import PackInputError

__all__ = ["PackInputError", "build_parser", "main", "run_pack", "verify"]

CREATED_BY = "torchtitan_loom.tools.pack"  # the pack metadata's created_by: this command


def _add_inputs(p: argparse.ArgumentParser) -> None:
    """The corpus flags, one argument group (their order is --help's)."""
    src = p.add_argument_group("inputs (at least one, unless --verify)")
    src.add_argument(
        "--jsonl",
        nargs="+",
        default=[],
        metavar="FILE",
        help="JSON-lines files or globs; one document per line, text in --text-field",
    )
    src.add_argument(
        "--text",
        nargs="+",
        default=[],
        metavar="FILE",
        help="plain-text files or globs; split into documents per --text-split",
    )
    src.add_argument(
        "--parquet",
        nargs="+",
        default=[],
        metavar="FILE",
        help="parquet files or globs (needs pyarrow); one document per row, text in --text-field",
    )
    src.add_argument(
        "--hf-dataset",
        default=None,
        metavar="NAME",
        help="a Hugging Face dataset (needs the optional extra: pip install 'torchtitan_loom[data]'): "
        "a hub name, a builder such as parquet/json with --hf-data-files, or a directory "
        "written by Dataset.save_to_disk; one document per row, text in --text-field",
    )
    src.add_argument(
        "--hf-config", default=None, metavar="C", help="configuration (subset) of --hf-dataset"
    )
    src.add_argument(
        "--hf-split",
        default=None,
        metavar="S",
        help="split of --hf-dataset (default: train); a single saved Dataset has none",
    )
    src.add_argument(
        "--hf-data-files",
        nargs="+",
        default=None,
        metavar="FILE",
        help="data files of a builder --hf-dataset (parquet, json, text, ...)",
    )
    src.add_argument(
        "--streaming",
        action="store_true",
        help="read --hf-dataset row by row as it downloads, never materialising it (no Arrow cache)",
    )
    src.add_argument(
        "--text-field", default="text", help="field / column holding the text in jsonl and parquet"
    )
    src.add_argument(
        "--text-split",
        choices=("file", "blankline", "line"),
        default="file",
        help="how --text files split into documents: the whole file, paragraphs "
        "separated by blank lines, or single lines",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_loom.tools.pack",
        description="Tokenise a corpus into the packed-document format read by the trainer, "
        "or check an existing pack with --verify.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_inputs(p)
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (built-in byte-level tokenizer) or a path to a Hugging Face tokenizer.json / its directory",
    )
    p.add_argument(
        "--eos-token",
        default=None,
        help="end-of-text token of a Hugging Face tokenizer; when unset: the one in tokenizer_config.json, "
        "else the first of <|endoftext|>, </s>, <eos> in the vocabulary)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output pack directory (must not exist unless --force)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    p.add_argument(
        "--seq-len",
        type=int,
        default=1024,
        help="record (chunk) length in tokens (metadata max_seq_len). A record of N tokens holds "
        "N - 1 inputs and their next-token targets, so it trains training.seq_len ≤ N - 1: "
        "--seq-len 1025 for training.seq_len 1024",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=9,
        help="number of shuffled training orderings epoch_0..epoch_{N-1}; the holdout is epoch_N",
    )
    p.add_argument(
        "--holdout-tokens",
        type=int,
        default=20_000_000,
        help="tokens held out for eval: the last records of the corpus, at most 10%% of records; 0 = none",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="tokenizer processes (output is identical for any number)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the training orderings (numpy default_rng)"
    )
    p.add_argument(
        "--verify",
        type=Path,
        default=None,
        metavar="DIR",
        help="check the pack in DIR, print its statistics, exit non-zero if it is invalid",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verify is not None:
        if args.out is not None or args.jsonl or args.text or args.parquet or args.hf_dataset:
            parser.error(
                "--verify DIR checks an existing pack; do not combine it with inputs or --out"
            )
        try:
            stats = verify(args.verify)
        except PackError as e:
            print(shorten_line(f"error: {e}"), file=sys.stderr)
            return exit_codes.BAD_INPUT
        for k, v in stats.items():
            print(f"{k}: {v}")
        return exit_codes.OK
    if args.out is None or not (args.jsonl or args.text or args.parquet or args.hf_dataset):
        parser.error(
            "packing needs --out and at least one of --jsonl / --text / --parquet / --hf-dataset "
            "(or use --verify DIR)"
        )
    try:
        out = run_pack(args, created_by=CREATED_BY)
    except (
        ValueError,
        ImportError,
        OSError,
    ) as e:  # PackInputError, a tokenizer, a write that failed
        print(shorten_line(f"error: {e}"), file=sys.stderr)
        return exit_codes.BAD_INPUT
    print(f"wrote {out}", file=sys.stderr)
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
