"""Float8 under FSDP2 on 2 gloo ranks (one torchrun launch): the tensorwise float8 all-gather
and the scale precompute after each optimizer step are applied, and the run trains like the
single-process float8 run (same global batches; tolerance as in unit/test_float8_training.py)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.trainer import Trainer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao not installed"
)

ROOT = Path(__file__).resolve().parents[2]
LOSS_TOL = 0.06  # see tests/unit/test_float8_training.py


def common(pack, dump):
    return [
        "--data.path",
        str(pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "8",
        "--training.micro_batch_size",
        "4",
        "--training.steps",
        "3",
        "--training.bp_segment_len",
        "1",
        "--optimizer.lr",
        "1e-3",
        "--training.mixed_precision_param",
        "bfloat16",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.log_freq",
        "1",
        "--eval.interval",
        "0",
        "--spike_guard.enable",
        "false",
        "--float8.enable",
        "--float8.emulate",
        "--float8.experts",
    ]


def test_fsdp_float8_all_gather_and_precompute_train_like_one_process(
    tiny_pack, tmp_path, launch_cost_s
):
    cfg = load_config(common(tiny_pack, tmp_path / "one"))
    tr = Trainer(cfg, resolve(cfg, 1), DistInfo(rank=0, world_size=1, device=torch.device("cpu")))
    assert not tr.parts.model_parts.float8_precompute  # no FSDP on one process
    batches = iter(tr.dataloader)
    ref = [tr.train_step(next(batches)).seg_losses[-1] for _ in range(3)]

    dump = tmp_path / "fsdp"
    args = [
        *common(tiny_pack, dump),
        "--float8.enable_fsdp_float8_all_gather",
        "--float8.precompute_float8_dynamic_scale_for_fsdp",
    ]
    # torchrun directly (run_train.sh would first start a third interpreter to check the config).
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "torchtitan_loom.train",
        *args,
    ]
    # The limit: 48 bare-launch costs (tests/launch_cost.py), 240 s at its 5 s floor.
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=48 * launch_cost_s,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "FSDP float8 all-gather + scale precompute" in out  # converter: the option
    assert (
        "their scales are precomputed after each optimizer step" in out
    )  # trainer: FSDP sharded them
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in rows]
    assert len(got) == 3 and max(abs(a - b) for a, b in zip(got, ref)) < LOSS_TOL, (got, ref)
