"""metrics.jsonl bytes per 1,000 steps for a preset, with and without expert_load on every logged row.

    python benchmarks/metrics_size.py [--config train_configs/loom_1p7b.toml]

Writes one row of each kind through the real MetricsLogger (TensorBoard off) into a temporary
folder and measures it: a plain logged training row, the same with ``expert_load`` ([L][H][E]
kept assignments, counts of the preset's global batch drawn at random, so the digits are as wide
as in a real run), and an eval row (per-loop losses and the routing / stream scalars). Rows per
1,000 steps follow from metrics.log_freq and eval.interval of the config.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from torchtitan_loom.components.observability.metrics import MetricsLogger
from torchtitan_loom.components.observability.routing_stats import RoutingStats
from torchtitan_loom.config import load_config
from torchtitan_loom.config.schema import Metrics
from torchtitan_loom.config.validate import resolve_model_args
from torchtitan_loom.protocols import segments


def row_sizes(config_file: str) -> dict[str, float]:
    cfg = load_config(["--job.config_file", config_file])
    a, t = resolve_model_args(cfg), cfg.training
    L, H, E, k = a.n_layers, a.num_loops, a.num_routed_experts, a.routed_top_k
    rng = np.random.default_rng(0)
    tokens = t.global_batch_size * t.seq_len
    load = rng.multinomial(tokens * k, [1 / E] * E, size=(L, H)).tolist()
    train = {
        "loss": rng.random() * 3,
        "lr": 6e-5,
        "grad_norm": rng.random(),
        "tokens_per_s": rng.random() * 1e6,
        "tflops": rng.random() * 400,
        "mfu": rng.random() * 50,
        "skipped": 0,
        "tokens_seen": 10**11,
        "memory_max_allocated_gib": rng.random() * 80,
        "memory_max_reserved_gib": rng.random() * 80,
    }
    train.update(
        {
            f"loss_segment_{j + 1}": rng.random() * 3
            for j in range(len(segments(H, t.bp_segment_len)))
        }
    )
    stats = RoutingStats(1, H, E, k)  # only for the names of the eval scalars
    names = _summary_names(stats)
    evals = {
        "eval_loss": rng.random(),
        "eval_tokens": cfg.eval.tokens,
        **{f"eval_loss_loop_{i + 1}": rng.random() * 3 for i in range(H)},
        **{n: float(rng.random()) for n in names},
    }
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {}
        for kind, scalars, extra in (
            ("train", train, None),
            ("train+load", train, {"expert_load": load}),
            ("eval+load", {**train, **evals}, {"expert_load": load}),
        ):
            path = os.path.join(tmp, kind + ".jsonl")
            with MetricsLogger(
                tmp, Metrics(enable_tensorboard=False), jsonl_name=kind + ".jsonl"
            ) as logger:
                logger.log(1000, scalars, extra)
            sizes[kind] = os.path.getsize(path)
    per_k = 1000 / cfg.metrics.log_freq
    evals_per_k = 1000 / cfg.eval.interval if cfg.eval.interval else 0
    return {
        "L*H*E": L * H * E,
        **sizes,
        "per_1000_steps_eval_only": (per_k - evals_per_k) * sizes["train"]
        + evals_per_k * sizes["eval+load"],
        "per_1000_steps_every_row": (per_k - evals_per_k) * sizes["train+load"]
        + evals_per_k * sizes["eval+load"],
    }


def _summary_names(stats: RoutingStats) -> list[str]:
    import torch

    stats.start_batch(torch.ones(1, 1, dtype=torch.bool))
    for _ in range(stats.H):
        stats.add_loop(
            torch.arange(stats.K).view(1, 1, 1, stats.K), torch.ones(1, 1, 2), torch.ones(1, 1)
        )
    return list(stats.summary())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="train_configs/loom_1p7b.toml")
    sizes = row_sizes(parser.parse_args().config)
    for key, value in sizes.items():
        print(f"{key:>28}: {value:,.0f}" + (" bytes" if key != "L*H*E" else ""))


if __name__ == "__main__":
    main()
