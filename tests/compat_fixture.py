"""The frozen run folder of an older commit (tests/fixtures/ckpt_3d15cf9/), which
tests/integration/test_old_checkpoint.py resumes on today's code: how it was written, and the
command that writes it again.

    git worktree add --detach /tmp/old 3d15cf9      # the pinned commit
    python tests/compat_fixture.py --old /tmp/old [--out tests/fixtures/ckpt_3d15cf9]

Everything stored is written by the old tree's own code (each a subprocess with PYTHONPATH=<old>,
OMP_NUM_THREADS=1): the tiny pack (its PackWriter), the run stopped and saved at step SAVED (its
trainer, ``run/``), and the same run uninterrupted to STEPS (its metrics, ``reference.jsonl``).
The folder is replaced whole but for its README.md; the old tree is only read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

COMMIT = "3d15cf9"
HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "fixtures", f"ckpt_{COMMIT}")
STEPS, SAVED = 8, 2  # the old run stops (and saves) at SAVED; the test resumes it to STEPS

# The debug model shrunk to a few hundred KB of checkpoint, in keys the old commit reads. Both
# commits run the same command, `--job.config_file train.toml` (a bare command line means another
# thing today: it starts from train_configs/debug_model.toml since the default preset came in).
# Relative paths: the test runs from a copy of the folder, and data.path is part of the run's
# identity (an absolute path would differ in the copy). No expert-bias update, no capacity
# dropping: both are discrete (a sign, a top-k keep), so on a CPU that rounds otherwise a near-tie
# could turn a 1-ulp difference into a jump, and the test's bound for such a CPU would not hold.
TRAIN_TOML = f"""\
[job]
dump_folder = "run"
[model]
name = "loom"
flavor = "debug"
vocab_size = 258
dim = 16
n_layers = 1
n_heads = 2
n_kv_heads = 1
num_loops = 3
num_routed_experts = 3
num_shared_experts = 1
top_k = 2
expert_intermediate_size = 16
max_seq_len = 32
load_balance_bias_lr = 0.0
capacity_factor = 0.0
[data]
path = "pack"
[training]
steps = {STEPS}
seq_len = 32
global_batch_size = 4
micro_batch_size = 2
bp_segment_len = 3
mixed_precision_param = "float32"
seed = 0
[optimizer]
lr = 3e-3
[lr_scheduler]
warmup_ratio = 0.25
[eval]
interval = 0
[metrics]
log_freq = 1
enable_tensorboard = false
[checkpoint]
enable = true
interval = 2
keep_latest_k = 1
"""
ARGS = ["--job.config_file", "train.toml"]

PACK = """
import numpy as np
from torchtitan_loom.components.data.pack_writer import PackWriter
rng = np.random.default_rng(0)
info = {"vocab_size": 258, "name_or_path": "byte", "eos_token_id": 256}
with PackWriter("pack", info, max_seq_len=33) as w:
    for i in range(120):
        a, b = int(rng.integers(0, 50)), int(rng.integers(0, 50))
        text = f"{a}+{b}={a + b}." if i % 2 else "the cat sat on the mat " * int(rng.integers(1, 3))
        w.add_document(np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64))
    w.finish(epochs=2, holdout_tokens=200, seed=0)
"""


def _run(old: str, cwd: str, argv: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=old, OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv[:3])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def train(old: str, cwd: str, *extra: str) -> None:
    _run(old, cwd, [sys.executable, "-m", "torchtitan_loom.train", *ARGS, *extra])


def losses(metrics_jsonl: str) -> dict[int, float]:
    """step -> loss of a metrics.jsonl (a step logged twice: the later launch's row wins)."""
    with open(metrics_jsonl) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help=f"a checkout of commit {COMMIT}")
    ap.add_argument("--out", default=FIXTURE)
    a = ap.parse_args()
    head = subprocess.run(
        ["git", "-C", a.old, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not head.startswith(COMMIT):
        sys.exit(f"--old {a.old} is at {head[:7]}, not {COMMIT}: check out {COMMIT} there")
    with tempfile.TemporaryDirectory() as work:
        _run(a.old, work, [sys.executable, "-c", PACK])
        with open(os.path.join(work, "train.toml"), "w") as fh:
            fh.write(TRAIN_TOML)
        os.makedirs(os.path.join(work, "straight"))
        shutil.copy(os.path.join(work, "train.toml"), os.path.join(work, "straight"))
        shutil.copytree(os.path.join(work, "pack"), os.path.join(work, "straight", "pack"))
        train(a.old, work, "--checkpoint.exit_after_step", str(SAVED))
        train(a.old, os.path.join(work, "straight"))  # the old commit's uninterrupted run
        out = os.path.abspath(a.out)
        readme = os.path.join(out, "README.md")  # kept: how the folder was written, by hand
        if os.path.isfile(readme):
            shutil.copy(readme, work)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        if os.path.isfile(os.path.join(work, "README.md")):
            shutil.copy(os.path.join(work, "README.md"), out)
        shutil.copytree(os.path.join(work, "pack"), os.path.join(out, "pack"))
        shutil.copy(os.path.join(work, "train.toml"), out)
        shutil.copytree(os.path.join(work, "run"), os.path.join(out, "run"))
        shutil.copy(
            os.path.join(work, "straight", "run", "metrics.jsonl"),
            os.path.join(out, "reference.jsonl"),
        )
    print(json.dumps({"written": out, "commit": head}))


if __name__ == "__main__":
    main()
