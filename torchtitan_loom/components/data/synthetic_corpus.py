"""The bundled synthetic corpus: deterministic generated text, no downloads, no copied prose.

Documents are a few lines of one kind each: multi-step tasks (variable-binding chains answered
without the steps, chained arithmetic with its intermediate results, sorting, string reversal,
counting) and simple templated prose. The rigid templates make the loss fall fast on a tiny
model; the answers of the multi-step tasks depend on several earlier tokens through a chain of
operations, which is where more loops of a looped model can help.

`write_bundled_pack` writes the pack (byte tokenizer, records of 257 tokens so the model trains at
S = 256, ~2% holdout). Run as a module it writes the pack or prints samples:

    python -m torchtitan_loom.components.data.synthetic_corpus [--out DIR] [--sample N] [--seed S]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from torchtitan_loom.components.runtime import exit_codes

CORPUS_NAME = "bundled-v1"  # bump when the generator or its settings change
MAX_SEQ_LEN = 257  # record length; model sequence length S = 256
TARGET_BYTES = 4_000_000
HOLDOUT_FRACTION = 0.02
TRAINING_ORDERINGS = 3
SEED = 0

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ren",
    "tos",
    "va",
    "pel",
    "dun",
    "shi",
    "gor",
    "ba",
    "ne",
    "qua",
    "fi",
    "mor",
    "zed",
    "lu",
    "tan",
    "ri",
    "bo",
    "sem",
    "cra",
    "vi",
    "dol",
)
NAMES = (
    "Ada",
    "Bram",
    "Cleo",
    "Dev",
    "Esme",
    "Finn",
    "Gala",
    "Hugo",
    "Iris",
    "Joss",
    "Kira",
    "Lev",
    "Mira",
    "Noor",
    "Otto",
    "Pia",
    "Quin",
    "Rosa",
    "Sami",
    "Tova",
)
ANIMALS = ("fox", "owl", "cat", "hare", "crow", "goat", "frog", "mole", "wren", "seal")
ADJS = ("red", "small", "quiet", "quick", "old", "brave", "sleepy", "green", "tall", "shy")
PLACES = ("market", "river", "forest", "library", "garden", "harbor", "hill", "kitchen", "field")
THINGS = ("apples", "stones", "shells", "books", "coins", "pears", "cups", "keys", "maps")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
VERBS = ("sing", "read", "swim", "dig", "paint", "run", "hide", "rest")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))


def _step(rng: random.Random, v: int) -> tuple[str, int]:
    """One operation that keeps the value in 0..99 (so the numbers stay two digits at most)."""
    ops = [("+", k) for k in range(1, 10) if v + k <= 99] + [
        ("-", k) for k in range(1, 10) if v - k >= 0
    ]
    ops += [("*", k) for k in (2, 3) if v * k <= 99]
    op, k = rng.choice(ops)
    return f"{op}{k}", (v + k if op == "+" else v - k if op == "-" else v * k)


def var_chain(rng: random.Random) -> str:
    """'a=3; b=a+4; c=b*2; c? 14' — each variable applies one operation to an earlier one; the
    answer needs the whole dependency chain (no intermediate results shown)."""
    names = rng.sample(LETTERS, rng.randint(3, 6))
    values = {names[0]: rng.randint(0, 9)}
    parts = [f"{names[0]}={values[names[0]]}"]
    for i, name in enumerate(names[1:], start=1):
        src = names[i - 1] if rng.random() < 0.7 else rng.choice(names[:i])
        op, values[name] = _step(rng, values[src])
        parts.append(f"{name}={src}{op}")
    q = names[-1] if rng.random() < 0.7 else rng.choice(names[1:])
    return "; ".join(parts) + f"; {q}? {values[q]}"


def var_chain_steps(rng: random.Random) -> str:
    """The same chains with every intermediate value written out: 'a=3; b=a+4=7; c=b*2=14'."""
    names = rng.sample(LETTERS, rng.randint(3, 6))
    v = rng.randint(0, 9)
    parts = [f"{names[0]}={v}"]
    for prev, name in zip(names, names[1:]):
        op, w = _step(rng, v)
        parts.append(f"{name}={prev}{op}={w}")
        v = w
    return "; ".join(parts)


def arithmetic(rng: random.Random) -> str:
    """'7 +5 *3 -4: 7+5=12, 12*3=36, 36-4=32. answer 32' (left to right)."""
    v = first = rng.randint(1, 20)
    ops, steps = [], []
    for _ in range(rng.randint(2, 5)):
        op, w = _step(rng, v)
        ops.append(op)
        steps.append(f"{v}{op}={w}")
        v = w
    return f"{first} {' '.join(ops)}: " + ", ".join(steps) + f". answer {v}"


def sort_list(rng: random.Random) -> str:
    """'sort 5 2 9 1 -> 1 2 5 9' (digits or two-digit numbers)."""
    hi = 9 if rng.random() < 0.6 else 99
    xs = [rng.randint(0, hi) for _ in range(rng.randint(3, 8))]
    return f"sort {' '.join(map(str, xs))} -> {' '.join(map(str, sorted(xs)))}"


def reverse_word(rng: random.Random) -> str:
    """'reverse kalomi -> imolak'."""
    w = _word(rng) if rng.random() < 0.7 else rng.choice(ANIMALS + PLACES + THINGS)
    return f"reverse {w} -> {w[::-1]}"


def count_items(rng: random.Random) -> str:
    """'count o in kalomo -> 2' or 'count x: x y x z -> 2'."""
    if rng.random() < 0.5:
        w = _word(rng) + _word(rng)
        c = rng.choice(w)
        return f"count {c} in {w} -> {w.count(c)}"
    pool = rng.sample(LETTERS, 3)
    xs = [rng.choice(pool) for _ in range(rng.randint(3, 9))]
    c = rng.choice(pool)
    return f"count {c}: {' '.join(xs)} -> {xs.count(c)}"


def prose(rng: random.Random) -> str:
    """A short templated story sentence pair, some with a little arithmetic."""
    a, b = rng.sample(NAMES, 2)
    n = rng.randint(2, 9)
    k = rng.randint(1, n - 1)
    forms = (
        f"{a} had {n} {rng.choice(THINGS)}. {a} gave {k} to {b}, so {a} had {n - k} left.",
        f"On {rng.choice(DAYS)} {a} walked to the {rng.choice(PLACES)} with {b}. "
        f"They saw a {rng.choice(ADJS)} {rng.choice(ANIMALS)} there.",
        f"The {rng.choice(ADJS)} {rng.choice(ANIMALS)} likes to {rng.choice(VERBS)} by the "
        f"{rng.choice(PLACES)}. {b} watched it for {n} minutes.",
        f"{a} found {n} {rng.choice(THINGS)} and {b} found {k} more. Together they had {n + k}.",
    )
    return rng.choice(forms)


TASKS: tuple[tuple[str, Callable[[random.Random], str], float], ...] = (
    ("variables", var_chain, 0.20),
    ("variables with steps", var_chain_steps, 0.10),
    ("arithmetic", arithmetic, 0.15),
    ("sorting", sort_list, 0.12),
    ("reversal", reverse_word, 0.11),
    ("counting", count_items, 0.10),
    ("story", prose, 0.22),
)


def generate_documents(seed: int = SEED, target_bytes: int = TARGET_BYTES) -> Iterator[str]:
    """Documents until about `target_bytes` of UTF-8 text: a title line and 2–6 lines of one task."""
    rng = random.Random(seed)
    weights = [w for _, _, w in TASKS]
    total = 0
    while total < target_bytes:
        title, make, _ = rng.choices(TASKS, weights=weights)[0]
        doc = f"{title}:\n" + "\n".join(make(rng) for _ in range(rng.randint(2, 6))) + "\n"
        total += len(doc)
        yield doc


def write_bundled_pack(out: Path, seed: int = SEED, target_bytes: int = TARGET_BYTES) -> Path:
    """Generate the corpus and write it as a byte-tokenised pack at `out` (atomic; raises
    FileExistsError if `out` already exists)."""
    from torchtitan_loom.components.data.pack_writer import PackWriter
    from torchtitan_loom.components.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    info = {
        "vocab_size": tok.vocab_size,
        "name_or_path": tok.name_or_path,
        "eos_token_id": tok.eos_id,
    }
    extra = {"corpus": CORPUS_NAME, "corpus_seed": seed}
    with PackWriter(out, info, MAX_SEQ_LEN, extra_metadata=extra) as w:
        for doc in generate_documents(seed, target_bytes):
            w.add_document(tok.encode_array(doc))
        holdout = max(1, int(w.total_tokens * HOLDOUT_FRACTION))
        return w.finish(epochs=TRAINING_ORDERINGS, holdout_tokens=holdout, seed=seed)


def main(argv: list[str] | None = None) -> int:
    """The corpus's own command line: ``--out DIR`` writes the pack, ``--sample N`` prints documents."""
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_loom.components.data.synthetic_corpus",
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
    if not args.sample and not args.out:
        p.error("nothing to do: pass --out DIR and/or --sample N")
    for _, doc in zip(range(args.sample), generate_documents(args.seed, args.target_bytes)):
        sys.stdout.write(doc + "\n")
    if args.out:
        t0 = time.perf_counter()
        write_bundled_pack(args.out, args.seed, args.target_bytes)
        print(f"wrote {args.out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
