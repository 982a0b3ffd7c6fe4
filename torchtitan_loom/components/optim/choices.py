"""The choices of [optimizer] and [lr_scheduler], without torch (the config reads them before torch
is imported; optimizer.py, lion.py and lr_scheduler.py implement them).

OPTIMIZERS is the optimizer table: one entry per optimizer, with the [optimizer] keys it reads
(the resume rule makes exactly these win over a checkpoint's), the fp32 state it keeps per
parameter (the dry run's estimate and the start line read it) and what that state is called. How
each is built is ``optimizer.BUILDERS`` under the same name (a test holds the two key sets equal).
An optimizer's name is part of the run (run.json's identity, each checkpoint's meta.json): a
resume under another is refused, since one optimizer's state is not another's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerInfo:
    """One row of the optimizer table."""

    hyper_keys: tuple[str, ...]
    """The [optimizer] keys this optimizer reads."""
    state_bytes_per_param: int
    """Bytes of optimizer state per parameter (fp32 state)."""
    state_label: str
    """What its state is called in the estimate's memory table."""


OPTIMIZERS = {
    # LOOM's (LOOM_SPEC §7.2): two fp32 moments per parameter.
    "AdamW": OptimizerInfo(("lr", "beta1", "beta2", "eps", "weight_decay"), 8, "AdamW moments"),
    # Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): one fp32 momentum,
    # a sign update. Elementwise, so it runs unchanged on FSDP and EP shards (Muon's orthogonalised
    # update needs each whole matrix: a gather per matrix and step under FSDP, and the routed
    # experts' 3-D weights per expert under EP; not offered).
    "Lion": OptimizerInfo(("lr", "beta1", "beta2", "weight_decay"), 4, "Lion momentum"),
}
OPTIMIZER_NAMES = tuple(OPTIMIZERS)
# Runs and checkpoints recorded before the optimizer was named: AdamW was the only one.
RECORDED_BEFORE_NAMES = "AdamW"
VALID_IMPLEMENTATIONS = ("foreach", "fused", "for-loop")
LR_KINDS = ("wsd", "cosine")
