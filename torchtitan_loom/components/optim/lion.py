"""Lion (Chen et al. 2023): the update is the sign of an interpolation of the momentum and the
gradient, so every coordinate moves by exactly lr (plus decoupled weight decay); one fp32 momentum
per parameter. Per parameter p with gradient g and momentum m (β1, β2):

    c = β1·m + (1 − β1)·g        p ← p·(1 − lr·wd) − lr·sign(c)        m ← β2·m + (1 − β2)·g

Elementwise only, so a parameter sharded by FSDP2 or expert parallelism (a DTensor) is updated
shard by shard with no communication. A parameter whose grad is None is skipped entirely (no
decay, no momentum update), as AdamW skips it: the segmented step relies on that for the routers
of loops outside the current segment.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class Lion(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if not lr > 0 or not all(0 <= b < 1 for b in betas) or not weight_decay >= 0:
            raise ValueError(f"Lion: lr > 0, betas in [0, 1), weight_decay ≥ 0; got {lr}, {betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["momentum"]
                direction = torch.lerp(p.grad, m, beta1).sign_()  # β1·m + (1 − β1)·g
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(direction, alpha=-lr)
                m.lerp_(p.grad, 1 - beta2)  # β2·m + (1 − β2)·g
        return loss
