"""Rank side of test_parallel_parity.py: train the debug model under several layouts in ONE launch.

Each case is a list of config overrides on top of the shared base; every rank builds the real
Trainer (ParallelDims -> parallelize_loom -> init) on the existing gloo process group and runs the
segmented steps. Rank 0 writes one JSON record per case, which the test compares with a single
process run of the same base config: losses per segment, grad norms, expert bias, kept counts,
initial weights (max |difference| from the plain single-process init) and AdamW step counts.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from gloo_rank import case_trainers, gloo_rank, load_spec  # next to this file
from torch.distributed.tensor import DTensor

from torchtitan_loom.trainer import Trainer


def record_run(trainer: Trainer, steps: int) -> dict:
    """The comparable facts of `steps` train steps of `trainer` (every rank calls it)."""
    data = iter(trainer.dataloader)
    losses, norms, counts = [], [], []
    for _ in range(steps):
        out = trainer.train_step(next(data))
        losses.append(out.seg_losses)
        norms.append(out.grad_norm)
        counts.append(out.counts_LHE.tolist())
    opt_steps = {}
    for name, p in trainer.model.named_parameters():
        state = trainer.optimizer.state.get(p, {})
        kind = "router" if ".moe.routers." in name else "other"
        opt_steps.setdefault(kind, set()).add(int(state["step"]) if "step" in state else 0)
    return {
        "seg_losses": losses,
        "grad_norms": norms,
        "expert_bias": [m.expert_bias.tolist() for m in trainer.model.moe_layers()],
        "counts": counts[-1],
        "counts_by_step": counts,
        "adam_steps": {k: sorted(v) for k, v in opt_steps.items()},
        # The learned exit head's weights (model.exit_head; [] without it), gathered whole.
        "exit_head": [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
            for p in trainer.model.exit_parameters()
        ],
        # What runs the routed experts: the installed module and what it wraps (EP), per layer
        # (fully_shard names its subclass "FSDP" + the class name).
        "experts": [
            [type(m).__name__.removeprefix("FSDP") for m in layer.experts.modules()]
            for layer in trainer.model.moe_layers()
        ],
    }


def init_difference(trainer: Trainer) -> float:
    """max |initial weight - single-process init| over all parameters (full tensors gathered)."""
    reference_model = trainer.parts.setting.spec.model_cls(trainer.model_args)
    reference_model.init_weights()
    reference = dict(reference_model.named_parameters())
    worst = 0.0
    for name, p in trainer.model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        worst = max(worst, (full.detach() - reference[name].detach()).abs().max().item())
    return worst


def run(rank: int, world: int, store_path: str, spec_path: str) -> None:
    """Entry point of a spawned rank: run every case of the spec file, rank 0 writes results."""
    with gloo_rank(rank, world, store_path) as info:
        spec = load_spec(spec_path)
        for case, trainer in case_trainers(spec, world, info):
            start = time.perf_counter()
            result = {"init_diff": init_difference(trainer), **record_run(trainer, case["steps"])}
            result["seconds"] = time.perf_counter() - start
            if rank == 0:
                with open(os.path.join(spec["out"], case["name"] + ".json"), "w") as fh:
                    json.dump(result, fh)
            torch._dynamo.reset()
            dist.barrier()
