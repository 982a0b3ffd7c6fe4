"""Rank side of test_diagnostics_dist.py: the real training loop of the debug model on 2 gloo
ranks with diagnostics every 2 steps, then a resumed launch. Forward hooks on the branch modules
(and a pre-hook on the model for the micro-batch's padding) record the activations of step 2, and
each rank writes what a direct computation on them gives: the norm and variance per micro-batch,
and the rank-collapse trio from the singular values of the sampled rows of micro-batch 0."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
from gloo_rank import build_trainer, gloo_rank  # next to this file

from torchtitan_loom.components.observability.diagnostics import sample_rows
from torchtitan_loom.trainer import Trainer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from rank_collapse_ref import direct_rank_collapse

RECORDED_STEP = 2


def recorder(trainer: Trainer) -> list[dict]:
    """One entry per forward of step RECORDED_STEP: loop range, padding mask, branch outputs."""
    calls: list[dict] = []
    model = trainer.model

    def pre(mod, args, kwargs):
        if trainer.state.step == RECORDED_STEP - 1:
            calls.append(
                {"loop_start": kwargs["loop_start"], "valid": args[2].reshape(-1) >= 0, "seen": []}
            )

    def branch(name):
        def hook(mod, args, out):
            if trainer.state.step == RECORDED_STEP - 1:
                calls[-1]["seen"].append(
                    (name, (out[0] if isinstance(out, tuple) else out).detach().clone())
                )

        return hook

    model.register_forward_pre_hook(pre, with_kwargs=True)
    for layer in model.layers:
        layer.attention.register_forward_hook(branch("attention"))
        layer.moe.register_forward_hook(branch("moe"))
    return calls


def direct(calls: list[dict], n_layers: int, micro: int) -> dict:
    """{"moments": {key: [value per micro-batch]}, "trio": {key: value}} of the recorded step."""
    moments: dict[str, list[float]] = {}
    trios: dict[str, float] = {}
    for c, call in enumerate(calls):
        it = iter(call["seen"])
        for t in range(
            call["loop_start"], call["loop_start"] + len(call["seen"]) // (2 * n_layers)
        ):
            for layer in range(n_layers):
                for _ in range(2):  # attention, then MoE
                    name, x = next(it)
                    x_ND = x.reshape(-1, x.shape[-1])
                    where = f"layer_{layer}/loop_{t}"
                    real = x_ND[call["valid"]]
                    moments.setdefault(f"diag/{name}/norm/{where}", []).append(
                        real.norm(dim=-1).mean().item()
                    )
                    moments.setdefault(f"diag/{name}/var/{where}", []).append(
                        real.var(correction=0).item()
                    )
                    if c % micro == 0:  # micro-batch 0 of its segment
                        rows = sample_rows(call["valid"], RECORDED_STEP)
                        for stat, v in zip(
                            ("erank", "top_sv", "cos"), direct_rank_collapse(x_ND[rows])
                        ):
                            trios[f"diag/{name}/{stat}/{where}"] = v
    return {"moments": moments, "trio": trios}


def run(rank: int, world: int, store_path: str, base: list[str], out: str) -> None:
    with gloo_rank(rank, world, store_path) as info:
        trainer = build_trainer(base + ["--training.steps", "4"], world, info)
        calls = recorder(trainer)
        assert trainer.train() == 0
        micro = (
            trainer.cfg.training.global_batch_size // world // trainer.cfg.training.micro_batch_size
        )
        with open(os.path.join(out, f"direct_rank{rank}.json"), "w") as fh:
            json.dump(direct(calls, trainer.model.args.n_layers, micro), fh)
        dist.barrier()
        assert (
            build_trainer(base + ["--training.steps", "6"], world, info).train() == 0
        )  # resumes from step 4
