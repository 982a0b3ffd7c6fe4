"""The contract between the data loaders, the loss and every model: what a batch's special values mean.

A batch is int64 [B, S] tensors ``input_ids``, ``labels``, ``positions`` and ``doc_ids``
(components/data/rows.py). A label of IGNORE_INDEX is not a target (the next token is in another
document or in padding); a padding slot has doc id PAD_DOC_ID (token 0, position 0), and real
tokens attend only within their own document.
"""

import torch

IGNORE_INDEX = -100
"""Label of a position that is not a target (torch's cross-entropy default ignore index too)."""
PAD_DOC_ID = -1
"""Doc id of a padding slot; real documents have doc ids ≥ 0."""


def real_tokens(doc_ids_BS: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: True on real tokens, False on padding."""
    return doc_ids_BS != PAD_DOC_ID
