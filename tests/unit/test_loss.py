"""Token CE sum and valid-token count against a hand computation."""

import math

import pytest
import torch

from torchtitan_loom.components.loss import count_valid, token_ce_sum


def test_ce_sum_matches_hand_computation():
    # B=1, S=3, V=2; the middle position is ignored.
    logits_BSV = torch.tensor([[[0.0, 0.0], [5.0, -5.0], [2.0, 0.0]]])
    labels_BS = torch.tensor([[1, -100, 1]])
    # CE = log(1 + e^0) for uniform logits; log(e^2 + e^0) - 0 for the third.
    expected = math.log(2.0) + math.log(math.exp(2.0) + 1.0)
    got = token_ce_sum(logits_BSV, labels_BS)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert got.item() == pytest.approx(expected, rel=1e-6)  # fp32 softmax rounding
    assert count_valid(labels_BS).item() == 2 and count_valid(labels_BS).dtype == torch.int64


def test_bf16_logits_upcast_and_sum_is_additive_over_rows():
    torch.manual_seed(0)
    logits_BSV = torch.randn(2, 5, 7).to(torch.bfloat16)
    labels_BS = torch.randint(0, 7, (2, 5))
    labels_BS[0, 0] = -100
    total = token_ce_sum(logits_BSV, labels_BS)
    assert total.dtype == torch.float32
    ref = -torch.log_softmax(logits_BSV.float(), -1).gather(-1, labels_BS.clamp(min=0)[..., None])
    ref = ref.squeeze(-1)[labels_BS != -100].sum()
    torch.testing.assert_close(total, ref, rtol=1e-6, atol=1e-6)  # same fp32 math, other order
    per_row = token_ce_sum(logits_BSV[:1], labels_BS[:1]) + token_ce_sum(
        logits_BSV[1:], labels_BS[1:]
    )
    torch.testing.assert_close(total, per_row, rtol=1e-6, atol=1e-6)
    assert count_valid(labels_BS).item() == 9


def test_all_ignored_gives_zero_and_bad_shapes_raise():
    assert token_ce_sum(torch.randn(1, 2, 3), torch.full((1, 2), -100)).item() == 0.0
    assert count_valid(torch.full((1, 2), -100)).item() == 0
    with pytest.raises(ValueError, match=r"\[B, S, V\]"):
        token_ce_sum(torch.randn(2, 3), torch.zeros(2, dtype=torch.long))
