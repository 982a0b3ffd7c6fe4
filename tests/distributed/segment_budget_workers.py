"""Rank side of test_segment_budget.py: what a train step costs per segment, per case.

Each case trains the debug model with the real Trainer on the existing gloo group: one uncounted
step (FSDP's lazy init, the optimizer state), then `steps` steps under a CollectiveCounter and a
HostSyncCounter. Rank 0 writes the collective counts, the host syncs (every rank must make the
same number: it checks its own) and the per-segment losses of the counted steps; for a case with
"dump", also the full parameters and gradients after the first step (gathered on every rank).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from gloo_rank import case_trainers, gloo_rank, load_spec  # next to this file
from torch.distributed.tensor import DTensor

from torchtitan_loom.distributed.comm_count import CollectiveCounter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from host_syncs import HostSyncCounter


def run(rank: int, world: int, store_path: str, spec_path: str) -> None:
    with gloo_rank(rank, world, store_path) as info:
        spec = load_spec(spec_path)
        for case, trainer in case_trainers(spec, world, info):
            data = iter(trainer.dataloader)
            trainer.train_step(next(data))
            if case.get("dump"):
                state = {
                    name: (_full(p.detach()), _full(p.grad))
                    for name, p in trainer.model.named_parameters()
                }
                if rank == 0:
                    torch.save(state, os.path.join(spec["out"], case["name"] + ".pt"))
            losses = []
            # AdamW's step counters live on the host by design: reading them is no device sync.
            steps = tuple(
                s["step"]
                for s in trainer.optimizer.state.values()
                if torch.is_tensor(s.get("step"))
            )
            with CollectiveCounter() as counter, HostSyncCounter(ignore=steps) as syncs:
                for _ in range(spec["steps"]):
                    losses.append(trainer.train_step(next(data)).seg_losses)
            per_step = len(syncs.calls) / spec["steps"]
            assert per_step == len(trainer.segments) or not case.get("sync_budget"), (
                f"rank {rank}, {case['name']}: {per_step} host syncs per step, {len(trainer.segments)} segments: {syncs.calls}"
            )
            if rank == 0:
                with open(os.path.join(spec["out"], case["name"] + ".json"), "w") as fh:
                    json.dump(
                        {
                            "counts": dict(counter.counts),
                            "seg_losses": losses,
                            "host_syncs": syncs.calls,
                            "segments": len(trainer.segments),
                        },
                        fh,
                    )
            dist.barrier()


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor on every rank (a collective for a DTensor: every rank calls it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
