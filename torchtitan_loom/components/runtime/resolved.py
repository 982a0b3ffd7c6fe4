"""What a launch ran with, as one flat record: run.json's ``resolved`` (every section, the [model]
overrides replaced by the model arguments they resolved to), and the part of it that says what a
run trains (``training_part``), which tools.study compares between variants and tools.compare
between groups. Torch-free."""

from __future__ import annotations

import dataclasses
from typing import Any

# Keys that say where a run lives and how it is kept or watched, not what it trains; the seed
# (and the init seed it gives) differs between the runs of one variant by design.
_NOT_TRAINING = ("job.", "checkpoint.", "metrics.", "profiling.", "comm.", "estimate.")
_PER_RUN = ("training.seed", "model_args.init_seed")


def flat_sections(d: dict[str, Any]) -> dict[str, Any]:
    """{section: {key: v}} as {"section.key": v} (values that are not tables kept as they are)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


def resolved_config(cfg: Any, model_args: Any) -> dict[str, Any]:
    """Dotted key -> value of everything a launch ran with: the config's sections (the [model]
    overrides replaced by the model arguments they resolved to, as ``model_args.<field>``)."""
    out = {k: v for k, v in flat_sections(cfg.to_dict()).items() if not k.startswith("model.")}
    out.update(
        {"model.name": cfg.model.name, "model.flavor": cfg.model.flavor},
        **{f"model_args.{k}": v for k, v in dataclasses.asdict(model_args).items()},
    )
    return out


def training_part(resolved: dict[str, Any]) -> dict[str, Any]:
    """The keys of a resolved record that decide what is trained (the seed aside)."""
    return {
        k: v for k, v in resolved.items() if not k.startswith(_NOT_TRAINING) and k not in _PER_RUN
    }
