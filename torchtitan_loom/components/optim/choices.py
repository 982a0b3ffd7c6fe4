"""The choices of [optimizer] and [lr_scheduler], without torch (the config reads them before torch
is imported; optimizer.py and lr_scheduler.py implement them)."""

OPTIMIZER_NAMES = ("AdamW",)
VALID_IMPLEMENTATIONS = ("foreach", "fused", "for-loop")
LR_KINDS = ("wsd", "cosine")
