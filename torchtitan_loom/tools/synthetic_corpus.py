"""`python -m torchtitan_loom.tools.synthetic_corpus`: write the bundled synthetic corpus as a pack
(`--out DIR`) or print sample documents (`--sample N`); the generator is
`components/data/synthetic_corpus.py`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from torchtitan_loom.components.data.synthetic_corpus import (
    SEED,
    TARGET_BYTES,
    generate_documents,
    write_bundled_pack,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_loom.tools.synthetic_corpus",
        description="Generate the bundled synthetic corpus.",
    )
    p.add_argument("--out", type=Path, help="write the pack to this directory (must not exist)")
    p.add_argument("--sample", type=int, default=0, help="print this many documents to stdout")
    p.add_argument("--seed", type=int, default=SEED, help=f"generator seed (default {SEED})")
    p.add_argument(
        "--target-bytes",
        type=int,
        default=TARGET_BYTES,
        help=f"approximate corpus size in bytes of text (default {TARGET_BYTES})",
    )
    args = p.parse_args(argv)
    if args.sample:
        for i, doc in zip(range(args.sample), generate_documents(args.seed, args.target_bytes)):
            sys.stdout.write(doc + "\n")
    if args.out:
        t0 = time.perf_counter()
        write_bundled_pack(args.out, args.seed, args.target_bytes)
        print(f"wrote {args.out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if not args.sample and not args.out:
        p.error("nothing to do: pass --out DIR and/or --sample N")
    return 0


if __name__ == "__main__":
    sys.exit(main())
