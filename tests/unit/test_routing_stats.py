"""Routing diversity metrics against a hand-computed example (1 row, 3 tokens, the last one padding)."""

import math

import pytest
import torch

from torchtitan_loom.components.observability.routing_stats import RoutingStats, load_entropy

# Top-k sets (k = 2 of E = 4) per token and loop; token 3 is padding and must not count.
SETS = [
    [(0, 1), (1, 2), (1, 2)],  # token 1: distinct {0,1,2} = 3; overlaps 1/2, 2/2
    [(0, 1), (0, 1), (2, 3)],  # token 2: distinct {0,1,2,3} = 4; overlaps 2/2, 0/2
    [(2, 3), (2, 3), (2, 3)],  # padding
]
# Stream after each loop, D = 2.
Z = [
    [(1.0, 0.0), (0.0, 2.0), (3.0, 4.0)],
    [(1.0, 1.0), (1.0, 1.0), (0.0, -1.0)],
    [(100.0, 100.0), (100.0, -100.0), (5.0, 5.0)],
]
VALID = torch.tensor([[True, True, False]])


def _feed(stats, layers=1, token_slices=(slice(0, 3),)):
    for sl in token_slices:
        stats.start_batch(VALID[:, sl])
        for t in range(3):
            topk_BSK = torch.tensor([[SETS[n][t] for n in range(3)]])[:, sl]
            z_BSD = torch.tensor([[Z[n][t] for n in range(3)]])[:, sl]
            rms_BS = z_BSD.pow(2).mean(-1).sqrt()  # the stream's own RMS (no closing norm here)
            stats.add_loop(topk_BSK.unsqueeze(0).expand(layers, -1, -1, -1), z_BSD, rms_BS)


def test_hand_computed_example():
    stats = RoutingStats(num_layers=1, num_loops=3, num_experts=4, top_k=2)
    _feed(stats)
    s = stats.summary()
    assert s["routing_distinct_experts"] == pytest.approx(3.5)
    assert s["routing_overlap_loop_1"] == pytest.approx(0.75)  # (1/2 + 2/2) / 2
    assert s["routing_overlap_loop_2"] == pytest.approx(0.5)  # (2/2 + 0/2) / 2
    assert s["routing_overlap"] == pytest.approx(0.625)
    # Loads: loop 1 (2,2,0,0), loop 2 (1,2,1,0), loop 3 (0,1,2,1).
    assert stats.load_LHE[0].tolist() == [[2, 2, 0, 0], [1, 2, 1, 0], [0, 1, 2, 1]]
    h23 = -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5)) / math.log(4)  # = 0.75
    assert s["routing_load_entropy_loop_1"] == pytest.approx(0.5)
    assert s["routing_load_entropy_loop_2"] == pytest.approx(h23) == pytest.approx(0.75)
    assert s["routing_load_entropy"] == pytest.approx((0.5 + 0.75 + 0.75) / 3)
    assert s["routing_load_max_mean_loop_1"] == pytest.approx(2.0)  # max 2 / mean 1
    assert s["routing_load_max_mean"] == pytest.approx(2.0)
    assert s["routing_dead_experts"] == 0  # every expert was chosen in some loop
    assert s["routing_dead_experts_per_loop"] == pytest.approx((2 + 1 + 1) / 3)
    assert s["stream_rms_loop_1"] == pytest.approx(math.sqrt((0.5 + 1.0) / 2))
    assert s["stream_rms_loop_2"] == pytest.approx(math.sqrt((2.0 + 1.0) / 2))
    assert s["stream_rms_loop_3"] == pytest.approx(math.sqrt((12.5 + 0.5) / 2))
    assert s["stream_cos_loop_1"] == pytest.approx((0.0 + 1.0) / 2)
    assert s["stream_cos_loop_2"] == pytest.approx((0.8 - 1 / math.sqrt(2)) / 2)
    assert stats.tokens.item() == 2


def test_layers_average_and_batches_accumulate():
    one = RoutingStats(1, 3, 4, 2)
    _feed(one)
    # Two identical layers, tokens fed as two micro-batches: same per-token means.
    two = RoutingStats(2, 3, 4, 2)
    _feed(two, layers=2, token_slices=(slice(0, 1), slice(1, 3)))
    assert two.summary() == pytest.approx(one.summary())
    assert len(two.per_layer()) == 2 and two.per_layer()[0] == pytest.approx(one.per_layer()[0])


def test_all_reduce_sums_every_total():
    stats = RoutingStats(1, 3, 4, 2)
    _feed(stats)
    before = stats.summary()
    stats.all_reduce(lambda t: t.mul_(2))  # two identical ranks
    assert stats.tokens.item() == 4 and stats.load_LHE[0, 0].tolist() == [4, 4, 0, 0]
    assert stats.summary() == pytest.approx(before)


def test_dead_expert_and_share():
    stats = RoutingStats(1, 2, 4, 1)
    stats.start_batch(torch.ones(1, 2, dtype=torch.bool))
    for ids in ([0, 1], [1, 1]):
        stats.add_loop(torch.tensor(ids).view(1, 1, 2, 1), torch.ones(1, 2, 3), torch.ones(1, 2))
    s = stats.summary()
    assert s["routing_dead_experts"] == 2  # experts 2 and 3 never chosen
    assert stats.load_share_LHE()[0].tolist() == [[2.0, 2.0, 0.0, 0.0], [0.0, 4.0, 0.0, 0.0]]
    assert s["routing_load_entropy_loop_2"] == 0.0 and s["stream_cos_loop_1"] == pytest.approx(1.0)


def test_empty_and_misuse():
    stats = RoutingStats(1, 2, 4, 1)
    assert stats.summary() == {} and stats.per_layer() == []
    with pytest.raises(RuntimeError, match="start_batch"):
        stats.add_loop(
            torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.ones(1, 1, 2), torch.ones(1, 1)
        )
    stats.start_batch(torch.ones(1, 1, dtype=torch.bool))
    stats.add_loop(torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.ones(1, 1, 2), torch.ones(1, 1))
    with pytest.raises(RuntimeError, match="1 of 2 loops"):
        stats.start_batch(torch.ones(1, 1, dtype=torch.bool))


def test_load_entropy_uniform_is_one():
    assert load_entropy(torch.ones(3, 8)).tolist() == pytest.approx([1.0] * 3)
