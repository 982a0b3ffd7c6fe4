"""Rank-side checks of test_checkpoint_dist.py, run in 2 gloo processes by one launch.

1. Async save over the manager's own gloo group while the "training" goes on: default-group
   collectives and in-place parameter/optimizer updates right after ``save()`` returns must
   neither abort gloo nor leak into the checkpoint; rank 0 commits it once DCP is done.
2. A refused entry in the newest checkpoint: every rank falls back to the previous one.
3. A commit refused on rank 0 (a planted snapshots/ link) stops every rank with the same line.
4. Preemption: a signal that reaches only rank 1 stops both ranks after the same step.
"""

from __future__ import annotations

import datetime
import os
import signal

import torch
import torch.distributed as dist

from torchtitan_loom.components.checkpoint import CheckpointManager, load_full, tree
from torchtitan_loom.components.optim.optimizer import build_optimizer
from torchtitan_loom.components.runtime.preemption import PreemptionWatcher
from torchtitan_loom.config.schema import Checkpoint, Optimizer
from torchtitan_loom.models.loom import LoomTransformer, loom_flavors


class _Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = int(sd["value"])


def _model() -> LoomTransformer:
    with torch.device("meta"):
        model = LoomTransformer(loom_flavors["debug"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    return model


def _manager(dump: str, rank: int, world: int, async_mode: str):
    model = _model()
    opt = build_optimizer(model, Optimizer(lr=1e-2))
    counter = _Counter()
    cfg = Checkpoint(
        enable=True, interval=1, keep_latest_k=0, async_mode=async_mode, save_on_signal=False
    )
    mgr = CheckpointManager(
        cfg,
        dump_folder=dump,
        model=model,
        optimizer=opt,
        states={"train_state": counter},
        model_args=loom_flavors["debug"],
        model_name="loom",
        flavor="debug",
        config_toml="",
        total_steps=10,
        device=torch.device("cpu"),
        rank=rank,
        world_size=world,
        log=lambda m: print(f"[rank {rank}] {m}", flush=True),
    )
    return mgr, model, opt, counter


def _step(model, opt) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    opt.step()


def check_async_save(rank: int, world: int, dump: str) -> None:
    mgr, model, opt, counter = _manager(dump, rank, world, "async")
    assert mgr.writer.pg is not None and mgr.writer.pg != dist.group.WORLD, (
        "async save needs its own process group"
    )
    _step(model, opt)
    counter.value = 7
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    mgr.save(1)  # returns once staged
    for _ in range(20):  # training continues: default-group collectives and updates, in flight
        t = torch.ones(1000)
        dist.all_reduce(t)
        assert t[0].item() == world
        _step(model, opt)
    counter.value = 8
    mgr.wait()
    dist.barrier()
    path = os.path.join(dump, "checkpoint", "step-1")
    assert tree.is_complete(path)
    saved = load_full(path)
    for k, v in expected.items():
        assert torch.equal(saved["model." + k], v), f"async checkpoint holds a later value of {k}"
    assert saved["train_state.value"] == 7
    # A fresh set of objects loads it through the process group (sync path).
    mgr2, model2, opt2, counter2 = _manager(dump, rank, world, "disabled")
    assert mgr2.load() == 1 and counter2.value == 7
    for k, v in expected.items():
        assert torch.equal(model2.state_dict()[k], v), k
    assert all(int(s["step"]) == 1 for s in opt2.state.values()) and len(opt2.state) == len(
        opt.state
    )
    mgr.close()
    mgr2.close()


def check_unreadable_entry_falls_back(rank: int, world: int, dump: str) -> None:
    """A pickle planted in a .distcp entry of the newest checkpoint (checksums matched): every rank
    falls back to the previous checkpoint together (DCP gathers the refusal to all of them)."""
    from tests.unit.planted_checkpoint import plant_entry_payload

    mgr, model, opt, counter = _manager(dump, rank, world, "disabled")
    assert mgr.load() == 1
    counter.value = 9
    mgr.save(2)
    mark = os.path.join(dump, "CODE_RAN")
    if rank == 0:
        plant_entry_payload(os.path.join(dump, "checkpoint", "step-2"), mark)
    dist.barrier()
    mgr2, _, _, counter2 = _manager(dump, rank, world, "disabled")
    assert mgr2.load() == 1 and counter2.value == 7, "every rank resumes from step 1"
    assert not os.path.exists(mark)
    mgr.close()
    mgr2.close()


def check_refused_commit_stops_every_rank(rank: int, world: int, dump: str) -> None:
    """A snapshots/ link planted before a save: rank 0 alone commits, and its refusal is raised
    on every rank with the same line (no rank left waiting at a barrier)."""
    from torchtitan_loom.components.checkpoint import CheckpointError

    mgr, _, _, _ = _manager(dump, rank, world, "disabled")
    outside, snaps = os.path.join(dump, "outside"), os.path.join(dump, "checkpoint", "snapshots")
    if rank == 0:
        os.makedirs(outside)
        os.symlink(outside, snaps)
    dist.barrier()
    try:
        mgr.save(3, periodic=True, snapshot=True)
        raise AssertionError("the save through a planted snapshots/ link was not refused")
    except CheckpointError as exc:
        said = str(exc)
    assert "checkpoint step 3 saved to" in said and "its snapshot was not saved" in said, said
    lines = [None] * world
    dist.all_gather_object(lines, said)
    assert len(set(lines)) == 1, lines
    assert os.listdir(outside) == []
    dist.barrier()
    if rank == 0:
        os.remove(snaps)
    mgr.close()


def check_preemption_agreement(rank: int) -> None:
    watcher = PreemptionWatcher(enabled=True)
    assert watcher.requested() == 0
    if rank == 1:
        signal.raise_signal(signal.SIGUSR1)
    assert watcher.requested() == signal.SIGUSR1, "every rank must stop after the same step"
    watcher.close()


def run(rank: int, world: int, store_path: str, dump: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        check_async_save(rank, world, dump)
        check_unreadable_entry_falls_back(rank, world, dump)
        check_refused_commit_stops_every_rank(rank, world, dump)
        check_preemption_agreement(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
