"""The dry run's activation memory (models/loom/infra/cost.py through distributed/estimate.py) against what
benchmarks/memory_time.py measures for the debug model, for every activation-checkpoint mode.

Each cell runs in its own process (its peak is its own): the resident-set growth over the steps, which
holds the gradients and AdamW moments (allocated in the first step), one micro-batch's activations,
the logits and the carry. The estimate of the same parts must lie within 25% (the issue's bound; the
measured gap is -10% .. +1%, see docs/parallelism.md). Without AC the activations are ~90% of it, with
block / loop AC ~70%, so a missing or doubled activation term moves the prediction well past 25%.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.estimate import estimate

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "memory_time.py"
sys.path.insert(0, str(SCRIPT.parent))
import memory_time  # noqa: E402

# One segment of 3 loops keeps each cell to three short steps on a loaded CPU.
CELL = ["--model.num_loops", "3", "--training.bp_segment_len", "3"]


@pytest.mark.parametrize("mode", memory_time.AC_MODES)
def test_predicted_activation_memory_matches_memory_time(mode):
    argv = memory_time.BASE + CELL + ["--activation_checkpoint.mode", mode]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cell", json.dumps(argv), "--steps", "1"],
        capture_output=True,
        text=True,
        env=memory_time._child_env(),
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"] * 2**20
    predicted = memory_time.estimated_mib(argv) * 2**20  # all but the parameters, allocated before
    cfg = load_config(argv + ["--training.device", "cpu", "--parallelism.dry_run"])
    est = estimate(cfg, *resolve(cfg, 1))
    activations = [v for k, v in est.memory.items() if k.startswith("activations")][0]
    assert activations > 0.5 * predicted  # the activation term dominates what is compared
    assert abs(predicted / measured - 1) <= 0.25, (mode, predicted / 2**20, measured / 2**20)
