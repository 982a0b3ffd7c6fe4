"""A run saved by an older commit (tests/fixtures/ckpt_3d15cf9, written by 3d15cf9: see
tests/compat_fixture.py) resumes on today's code with the losses of an uninterrupted run.

Why resumed == from scratch is exact: both runs are one process, OMP_NUM_THREADS=1, float32, and
the LOOM step draws no random numbers, so a step is a fixed sequence of float operations on one
machine, and the checkpoint holds every tensor of the state bit for bit (model, AdamW moments,
expert bias, lr schedule, data cursor, RNG). Two runs of today's code on this machine that start
a step from the same state therefore compute the same losses from there on. So the resumed steps
equal the uninterrupted ones exactly when the state the old commit saved is the one today's code
reaches at that step here: checked tensor by tensor against the uninterrupted run's own
checkpoint of the step. It holds on the kind of CPU that wrote the fixture (as here). On another
kind the matmul kernels (AVX2 / AVX-512 / AMX code paths) round differently in the low bits, the
two states differ by ulps, and both comparisons fall back to OTHER_CPU_REL (see its measurement).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tests import compat_fixture as fx
from torchtitan_loom.components.checkpoint import load_full
from torchtitan_loom.components.checkpoint.resolve import FORMAT_VERSION
from torchtitan_loom.components.runtime.run_folder import RUN_FORMAT_VERSION

ROOT = Path(__file__).resolve().parents[2]
# Other kernels, emulated here (ATEN_CPU_CAPABILITY=avx2 or default, with MKL_ENABLE_INSTRUCTIONS
# and ONEDNN_MAX_CPU_ISA lowered to match): today's code from scratch and resumed from the fixture
# stayed within 6.5e-8 relative of the old run's losses over the 8 steps (a float32 loss near 6
# has ulps of 8e-8 relative), and within 8.7e-8 of each other. The fixture's routing has no
# discrete update that could turn that into a jump (tests/compat_fixture.py), so 1e-5, about 100x
# the measured spread, is loose for rounding and tight for any change to what a step computes.
OTHER_CPU_REL = 1e-5


def train(cwd: Path, *extra: str) -> str:
    """Today's trainer on the fixture's arguments, in ``cwd`` (a user's command line)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.train", *fx.ARGS, *extra],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def same_state(a: Path, b: Path) -> bool:
    """The model and optimizer tensors of two checkpoints are equal bit for bit."""
    sa, sb = load_full(str(a)), load_full(str(b))
    keys = [
        k for k in sa if k.startswith(("model.", "optimizer.state.")) and torch.is_tensor(sa[k])
    ]
    assert keys and all(k in sb for k in keys)
    return all(torch.equal(sa[k], sb[k]) for k in keys)


def close(a: dict[int, float], b: dict[int, float]) -> bool:
    return a.keys() == b.keys() and all(abs(a[s] - b[s]) <= OTHER_CPU_REL * abs(b[s]) for s in a)


def test_a_run_saved_by_3d15cf9_resumes_with_the_losses_of_an_uninterrupted_run(tmp_path):
    old = tmp_path / "old"
    shutil.copytree(fx.FIXTURE, old)
    meta = json.loads((old / "run" / "checkpoint" / f"step-{fx.SAVED}" / "meta.json").read_text())
    assert "format_version" not in meta  # the legacy format, accepted on load
    out = train(old)
    assert f"resumed from run/checkpoint/step-{fx.SAVED} (step {fx.SAVED})" in out, out[-2000:]
    resumed = fx.losses(str(old / "run" / "metrics.jsonl"))
    run = json.loads((old / "run" / "run.json").read_text())
    assert (run["status"], run["step"], len(run["launches"])) == ("finished", fx.STEPS, 2)
    assert "format_version" not in json.loads((Path(fx.FIXTURE) / "run" / "run.json").read_text())
    assert run["format_version"] == RUN_FORMAT_VERSION  # the legacy run.json, carried on
    newest = json.loads((old / "run" / "checkpoint" / f"step-{fx.STEPS}" / "meta.json").read_text())
    assert newest["format_version"] == FORMAT_VERSION

    fresh = tmp_path / "fresh"
    shutil.copytree(Path(fx.FIXTURE) / "pack", fresh / "pack")
    shutil.copy(Path(fx.FIXTURE) / "train.toml", fresh)
    train(fresh, "--checkpoint.keep_latest_k", "0")  # keeps its step-SAVED to compare
    scratch = fx.losses(str(fresh / "run" / "metrics.jsonl"))
    reference = fx.losses(os.path.join(fx.FIXTURE, "reference.jsonl"))
    after = range(fx.SAVED + 1, fx.STEPS + 1)
    assert sorted(resumed) == sorted(scratch) == sorted(reference) == list(range(1, fx.STEPS + 1))
    saved = Path("run") / "checkpoint" / f"step-{fx.SAVED}"
    if same_state(Path(fx.FIXTURE) / saved, fresh / saved):  # this CPU computes as the fixture's
        assert [resumed[s] for s in after] == [scratch[s] for s in after]
        assert [resumed[s] for s in after] == [reference[s] for s in after]
    else:
        print(f"this CPU rounds otherwise than the fixture's: within {OTHER_CPU_REL:g} relative")
        assert close({s: resumed[s] for s in after}, {s: scratch[s] for s in after})
        assert close({s: resumed[s] for s in after}, {s: reference[s] for s in after})
