"""Small input batches shared by unit tests (imported by name: tests/unit is on sys.path)."""

import torch


def two_document_batch(B: int = 2, S: int = 16):
    """tokens, positions, doc ids [B, S]: a 6-token document, then one of S - 6 tokens, in every row."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (B, S), generator=g)
    positions = torch.cat([torch.arange(6), torch.arange(S - 6)]).expand(B, S)
    doc_ids = torch.tensor([0] * 6 + [1] * (S - 6)).expand(B, S)
    return tokens, positions, doc_ids
