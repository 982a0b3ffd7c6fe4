"""Issue 43: a finite explosion right after a resume keeps a checkpoint from before it, on the
multi-segment preset (train_configs/debug_model.toml: 3 loops), with one backprop segment per loop
and one of all three, sync and async saves. The proof's reference (proof.py) is the first
segment's loss of the launch's first step, measured before any update at the new lr."""

import json
import math
from pathlib import Path

import pytest

from tests.unit.test_checkpoint import make_trainer, run
from torchtitan_loom.components.checkpoint import tree

PRESET = str(Path(__file__).resolve().parents[2] / "train_configs" / "debug_model.toml")
KEEP = ("--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1")


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
@pytest.mark.parametrize("bp_segment_len", ["1", "3"])
def test_an_explosion_after_a_resume_keeps_a_checkpoint_from_before_it(
    tiny_pack, tmp_path, bp_segment_len, async_mode
):
    # The preset's spike guard warm-up (50 steps) lets the exploded losses feed its average until
    # the plateau is "healthy" (the campaign's case): only the proof's loss bound keeps step 8.
    common = ("--job.config_file", PRESET, "--training.bp_segment_len", bp_segment_len, *KEEP)
    common += ("--checkpoint.async_mode", async_mode)
    run(make_trainer(tiny_pack, tmp_path, *common, "--training.steps", "8"))
    run(
        make_trainer(tiny_pack, tmp_path, *common, "--training.steps", "36", "--optimizer.lr", "10")
    )
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    seg = {r["step"]: segment_losses(r) for r in rows if "loss" in r}
    assert len(seg[9]) == (3 if bp_segment_len == "1" else 1)
    assert all(math.isfinite(v) for v in seg[36])
    assert min(max(seg[s]) for s in range(20, 37)) > 5 * seg[9][0], seg  # it exploded, finitely
    kept = [e.step for e in tree.scan(str(tmp_path / "checkpoint")).of_kind("periodic")]
    assert min(kept) <= 8, kept  # a checkpoint from before the explosion survives


def segment_losses(row):
    return [row[f"loss_segment_{j}"] for j in range(1, 4) if f"loss_segment_{j}" in row]
