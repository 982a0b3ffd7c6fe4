"""Host-sync budget of Trainer.train_step: without expert parallelism a step makes exactly one
device-to-host transfer per backprop segment — the all-reduced [loss sum, grad-norm², non-finite
flag] vector that the spike guard and the clip both read — and a diagnostic step (metrics.diag_*)
exactly one more, at its end."""

import pytest
import torch
from host_syncs import HostSyncCounter

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.trainer import Trainer

CPU = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))
HOST_SYNCS_PER_SEGMENT = 1  # the budget


def make_trainer(pack_dir, tmp_path, *extra):
    argv = [
        "--data.path",
        str(pack_dir),
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.seq_len",
        "32",
        "--metrics.enable_tensorboard",
        "false",
        "--eval.interval",
        "0",
        "--model.num_loops",
        "6",
        "--training.bp_segment_len",
        "2",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        *extra,
    ]
    cfg = load_config(argv)
    return Trainer(cfg, resolve(cfg, 1), CPU)


def counted_step(trainer, batch):
    # AdamW's step counters are host tensors (not capturable): reading them is no device sync.
    steps = tuple(
        s["step"] for s in trainer.optimizer.state.values() if torch.is_tensor(s.get("step"))
    )
    with HostSyncCounter(ignore=steps) as counter:
        out = trainer.train_step(batch)
    return out, counter.calls


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_one_host_sync_per_segment(precision, tiny_pack, tmp_path):
    tr = make_trainer(
        tiny_pack,
        tmp_path,
        "--training.mixed_precision_param",
        precision,
        "--training.max_norm",
        "1.0",
    )
    batches = iter(tr.dataloader)
    tr.train_step(next(batches))  # creates the optimizer state
    out, calls = counted_step(tr, next(batches))
    assert out.skip_reason is None and len(out.seg_losses) == 3
    assert len(calls) == HOST_SYNCS_PER_SEGMENT * len(tr.segments), calls


def test_guard_and_clip_read_the_same_statistics(tiny_pack, tmp_path):
    # A spike skips the segment after its one sync: no second transfer for the clip.
    tr = make_trainer(
        tiny_pack,
        tmp_path,
        "--training.mixed_precision_param",
        "float32",
        "--spike_guard.enable",
        "true",
        "--spike_guard.warmup_steps",
        "0",
    )
    batches = iter(tr.dataloader)
    tr.train_step(next(batches))
    for _ in range(300):  # segment 1's baseline goes to ~0: its next loss is a spike
        tr.spike_guard.accept(0, 0.0)
    out, calls = counted_step(tr, next(batches))
    assert out.skip_reason is not None and out.skip_reason.startswith("segment 1")
    assert len(calls) == HOST_SYNCS_PER_SEGMENT, calls


def test_a_diagnostic_step_adds_one_transfer(tiny_pack, tmp_path):
    tr = make_trainer(
        tiny_pack,
        tmp_path,
        "--training.mixed_precision_param",
        "float32",
        "--metrics.diag_interval",
        "2",
        "--metrics.diag_grad",
        "true",
    )
    batches = iter(tr.dataloader)
    tr.train_step(next(batches))  # step 1: creates the optimizer state
    out, calls = counted_step(tr, next(batches))  # step 2: every diagnostic on
    assert out.diag and all(v is not None for v in out.diag.values())
    assert len(calls) == HOST_SYNCS_PER_SEGMENT * len(tr.segments) + 1, calls
    assert calls[-1][1].startswith("diagnostics.py"), (
        calls
    )  # the one read of everything, at the end
    out, calls = counted_step(
        tr, next(batches)
    )  # step 3: not a diagnostic step, the budget as without
    assert out.diag is None and len(calls) == HOST_SYNCS_PER_SEGMENT * len(tr.segments), calls
