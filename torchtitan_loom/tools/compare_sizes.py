"""tools.compare's model sizes: params, active params and FLOPs per token of the runs whose run.json
predates their record, from the model their config.toml builds on the meta device (the current
code's count). The one part of tools.compare that imports torch."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from torchtitan_loom.components.checkpoint import names
from torchtitan_loom.config.manager import ConfigError, load_config
from torchtitan_loom.tools.compare_runs import RunSummary, Warn


def model_sizes(runs: list[RunSummary], warn: Warn) -> None:
    """params and active_params of each run (and FLOPs per token where the metrics had none):
    the model its config.toml builds, on the meta device (one build per distinct model)."""
    import torch

    from torchtitan_loom.config.validate import resolve_model_args
    from torchtitan_loom.protocols import get_train_spec, segments

    built: dict[str, tuple[int, int, float]] = {}
    for run in runs:
        path = os.path.join(run.path, names.CONFIG_TOML)
        if run.params is not None and run.flops_per_token is not None:
            continue  # recorded by the trainer in run.json
        if not run.config:  # flat_config said why
            continue
        try:
            cfg = load_config(["--job.config_file", path])
            args = resolve_model_args(cfg)
        except ConfigError as exc:
            warn(f"{path}: the model cannot be built ({str(exc).splitlines()[0]}); params unknown")
            continue
        t = cfg.training
        shape = {k: v for k, v in dataclasses.asdict(args).items() if k != "init_seed"}
        key = repr((cfg.model.name, sorted(shape.items()), t.seq_len, t.bp_segment_len))
        if key not in built:
            try:
                with torch.device("meta"):
                    model: Any = get_train_spec(cfg.model.name).model_cls(args)
            except (KeyError, ValueError, TypeError) as exc:
                warn(f"{path}: the model cannot be built ({exc}); params unknown")
                continue
            counts = model.param_counts()
            n_seg = len(segments(model.num_loops, t.bp_segment_len))
            built[key] = (
                counts["total"],
                counts["active"],
                model.flops_per_token(t.seq_len, n_seg),
            )
        run.params, run.active_params, fpt = built[key]
        run.flops_per_token = run.flops_per_token or fpt
