"""The export's command line, torch-free, so that what needs no checkpoint is answered before torch
is imported (seconds on a cold start): ``--help``, a bad option, and an OUT folder that cannot
receive an export without ``--force`` (it holds files, is a file, or a link on the way), one line
and exit 2 in a fraction of a second. tools/export.py runs the export itself."""

from __future__ import annotations

import argparse
import sys

from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.runtime.messages import shorten_line
from torchtitan_loom.distributed.choices import DTYPE_NAMES
from torchtitan_loom.tools.export_format import ExportError
from torchtitan_loom.tools.out_files import check_out

FORMATS = ("safetensors", "hf")


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_loom.tools.export", description=description
    )
    parser.add_argument(
        "ckpt", help="checkpoint directory (step-N), checkpoint folder or run dump folder"
    )
    parser.add_argument("out", help="output directory")
    parser.add_argument(
        "--dtype",
        default="fp32",
        choices=tuple(DTYPE_NAMES.values()),
        help="parameter dtype of the export",
    )
    parser.add_argument(
        "--verify", action="store_true", help="re-read the export and compare it bit for bit"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="overwrite the files of an existing export in OUT "
        "(without it, OUT must be absent or empty)",
    )
    parser.add_argument(
        "--format",
        default="safetensors",
        choices=FORMATS,
        help="safetensors: model file + model_args.json; hf: a transformers folder "
        "(AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True))",
    )
    return parser


def answer_early(argv: list[str], description: str) -> None:
    """Exit now (2, one line) when the command line is bad or OUT is occupied without --force;
    return otherwise. With --force the export's own file names decide, after torch."""
    ns = build_parser(description).parse_args(argv)  # --help and bad options exit here
    if ns.force:
        return
    try:
        check_out(ns.out, False, frozenset(), ExportError)  # without --force no name is ours
    except (ExportError, OSError) as exc:
        print(shorten_line(f"export error: {exc}"), file=sys.stderr)
        sys.exit(exit_codes.BAD_INPUT)
