"""Rank side of test_stop_agreement.py: a real Trainer's loop on 2 gloo ranks with every collective
and host sync counted per loop iteration (the step and what follows it: metrics, divergence
check, checkpoint policy, stop decision), with checkpoints on (the stop signals watched) and off
(not watched); then a SIGTERM that only rank 1 receives, in the middle of step 3.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections import Counter

from gloo_rank import build_trainer, gloo_rank, load_spec  # next to this file

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.comm_count import CollectiveCounter
from torchtitan_loom.trainer import Trainer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from host_syncs import HostSyncCounter


class MarkingTrainer(Trainer):
    """Notes the counters at every step's start: the difference of two marks is one iteration."""

    def train_step(self, batch):
        self.marks.append((Counter(self.collectives.counts), list(self.syncs.calls)))
        return super().train_step(batch)


def _counted(spec: dict, info, out: str, extra: list[str]) -> dict:
    cfg = load_config(spec["base"] + extra + ["--job.dump_folder", out])
    trainer = MarkingTrainer(cfg, resolve(cfg, info.world_size), info)
    trainer.marks = []
    with CollectiveCounter() as trainer.collectives, HostSyncCounter() as trainer.syncs:
        code = trainer.train()
    # Iterations 2 and 3 (step 1 has the lazy inits; the loop's last one is not followed by a mark).
    per_iteration = []
    for (c0, s0), (c1, s1) in zip(trainer.marks[1:3], trainer.marks[2:4]):
        syncs = [where for _, where in s1[len(s0) :] if not where.startswith(("adam", "optim"))]
        per_iteration.append({"collectives": dict(c1 - c0), "host_syncs": syncs})
    return {"code": code, "segments": len(trainer.segments), "iterations": per_iteration}


def _signalled(spec: dict, info, out: str) -> dict:
    argv = spec["base"] + spec["checkpoints"] + ["--job.dump_folder", out]
    trainer = build_trainer(argv, info.world_size, info)

    def hook(module, args):  # rank 1 only, at step 3's first forward: before any update
        if info.rank == 1 and module.training and trainer.state.step == 2:
            if not trainer.stop_signals.received:
                signal.raise_signal(signal.SIGTERM)

    trainer.model.register_forward_pre_hook(hook)
    code = trainer.train()
    return {"code": code, "step": trainer.state.step, "received": trainer.stop_signals.received}


def run(rank: int, world: int, store_path: str, spec_path: str) -> None:
    with gloo_rank(rank, world, store_path) as info:
        spec = load_spec(spec_path)
        result = {
            "watched": _counted(spec, info, os.path.join(spec["out"], "on"), spec["checkpoints"]),
            "unwatched": _counted(spec, info, os.path.join(spec["out"], "off"), []),
            "signalled": _signalled(spec, info, os.path.join(spec["out"], "signalled")),
        }
        with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
