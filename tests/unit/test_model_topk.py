"""return_topk: the model hands out the routed expert ids per layer and loop only when asked, and
they are the ids the MoE actually routed (their counts equal the kept counts without capacity)."""

import pytest
import torch

from torchtitan_loom.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtitan_loom.loop_request import LoopRequest
from torchtitan_loom.models.loom import LoomTransformer, loom_flavors


def _model(**changes):
    model = LoomTransformer(loom_flavors["debug"].replace(**changes))
    model.init_weights()
    return model.eval()


def _batch(B=2, S=16):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (B, S), generator=g)
    positions = torch.arange(S).expand(B, S)
    return tokens, positions, torch.zeros(B, S, dtype=torch.long)


def _counts_from_ids(topk_LTBSK, E):
    L, T = topk_LTBSK.shape[:2]
    flat = topk_LTBSK.reshape(L, T, -1)
    return torch.zeros(L, T, E, dtype=torch.long).scatter_add_(2, flat, torch.ones_like(flat))


@torch.no_grad()
def test_topk_only_when_asked_and_matches_routing():
    model = _model(capacity_factor=0.0)  # no dropping: kept counts = routed counts
    a = model.args
    plain = model(*_batch())
    assert plain.topk_LTBSK is None
    out = model(*_batch(), request=LoopRequest(return_topk=True))
    assert out.topk_LTBSK.shape == (a.n_layers, a.num_loops, 2, 16, a.routed_top_k)
    assert out.topk_LTBSK.dtype == torch.int64
    torch.testing.assert_close(out.logits_BSV, plain.logits_BSV, rtol=0, atol=0)
    assert torch.equal(_counts_from_ids(out.topk_LTBSK, a.num_routed_experts), out.counts_LTE)
    # Each token's k ids are distinct experts.
    ids = out.topk_LTBSK.sort(-1).values
    assert (ids[..., 1:] != ids[..., :-1]).all()


@torch.no_grad()
def test_topk_per_loop_range_equals_full_forward():
    model = _model()
    full = model(*_batch(), request=LoopRequest(return_topk=True))
    carry, pieces = None, []
    for t in range(1, model.num_loops + 1):
        out = model(
            *_batch(), loop_start=t, loop_end=t, carry=carry, request=LoopRequest(return_topk=True)
        )
        carry = out.carry
        pieces.append(out.topk_LTBSK)
    assert torch.equal(torch.cat(pieces, dim=1), full.topk_LTBSK)


@pytest.mark.parametrize("mode", ["block", "loop"])
@torch.no_grad()
def test_topk_through_activation_checkpoint_wrappers(mode):
    ref = _model()
    expected = ref(*_batch(), request=LoopRequest(return_topk=True)).topk_LTBSK
    model = _model()
    apply_activation_checkpointing(model, mode)
    assert torch.equal(model(*_batch(), request=LoopRequest(return_topk=True)).topk_LTBSK, expected)
