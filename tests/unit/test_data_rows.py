"""Row packing: next-fit row starts, record splitting, batch tensor assembly."""

import numpy as np
import pytest
import torch

from torchtitan_loom.components.data.rows import (
    IGNORE_INDEX,
    RowPlan,
    assemble_rows,
    next_fit_row_starts,
    plan_rows,
    split_records,
)


def naive_row_starts(lens, C):
    """The definition: a piece joins the current row if it fits, else starts a new row."""
    starts, fill = [], C + 1
    for j, n in enumerate(lens):
        if fill + n > C:
            starts.append(j)
            fill = 0
        fill += n
    return np.array(starts + [len(lens)])


@pytest.mark.parametrize("seed", range(40))
def test_next_fit_matches_definition_random(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    # Small blocks so that many block boundaries and the fix-up walk are exercised.
    monkeypatch.setattr("torchtitan_loom.components.data.rows._BLOCK", int(rng.integers(1, 40)))
    C = int(rng.integers(2, 50))
    lens = rng.integers(1, C + 1, size=int(rng.integers(1, 2000)))
    np.testing.assert_array_equal(next_fit_row_starts(lens, C), naive_row_starts(lens, C))


@pytest.mark.parametrize(
    "lens,C",
    [
        (np.full(1000, 5), 12),  # equal lengths: guessed chains never merge (worst case)
        (np.full(1000, 12), 12),  # one piece per row
        (np.ones(1000, int), 7),  # many pieces per row, rows span blocks
        (np.array([7]), 7),
        (np.zeros(0, int), 7),
    ],
)
def test_next_fit_matches_definition_edge_cases(lens, C, monkeypatch):
    monkeypatch.setattr("torchtitan_loom.components.data.rows._BLOCK", 3)
    np.testing.assert_array_equal(next_fit_row_starts(lens, C), naive_row_starts(lens, C))


def test_next_fit_large_default_block():
    rng = np.random.default_rng(0)
    lens = np.minimum(rng.integers(2, 400, 50_000), 257)
    np.testing.assert_array_equal(next_fit_row_starts(lens, 257), naive_row_starts(lens, 257))


def test_split_records_cuts_long_records_and_drops_one_token_pieces():
    start = np.array([0, 100, 200])
    length = np.array([10, 3, 1])  # 10 → 4+4+2 ; 3 stays ; 1 dropped (no target)
    s, n = split_records(start, length, 4)
    assert s.tolist() == [0, 4, 8, 100]
    assert n.tolist() == [4, 4, 2, 3]
    s, n = split_records(np.array([0]), np.array([9]), 4)  # 4+4+1: the 1-token tail goes
    assert s.tolist() == [0, 4] and n.tolist() == [4, 4]


def test_assemble_rows_plan_labels_positions_padding():
    tokens = np.arange(100, 200, dtype=np.uint16)
    # C = 6: row 0 = records (0,3) + (10,2); row 1 = record (20,5); row 2 = (30,6)
    plan = plan_rows(np.array([0, 10, 20, 30]), np.array([3, 2, 5, 6]), 6)
    assert plan.row_first.tolist() == [0, 2, 3, 4]
    assert plan.label_counts().tolist() == [2 + 1, 4, 5]
    b = assemble_rows(tokens, plan, 0, 3)
    assert all(v.dtype == torch.int64 and v.shape == (3, 5) for v in b.values())
    assert b["input_ids"][0].tolist() == [100, 101, 102, 110, 111]
    assert b["positions"][0].tolist() == [0, 1, 2, 0, 1]
    assert b["doc_ids"][0].tolist() == [0, 0, 0, 1, 1]
    # target of pos 2 is the first token of the next record, of pos 4 is padding → ignored
    assert b["labels"][0].tolist() == [101, 102, IGNORE_INDEX, 111, IGNORE_INDEX]
    assert b["input_ids"][1].tolist() == [120, 121, 122, 123, 124]
    assert b["labels"][1].tolist() == [121, 122, 123, 124, IGNORE_INDEX]
    assert b["doc_ids"][1].tolist() == [0, 0, 0, 0, 0]
    assert b["input_ids"][2].tolist() == [130, 131, 132, 133, 134]
    assert b["labels"][2].tolist() == [131, 132, 133, 134, 135]  # a full row: last label is real


def test_assemble_rows_padding_values_and_extra_empty_rows():
    tokens = np.arange(50, dtype=np.uint16)
    plan = plan_rows(np.array([5]), np.array([3]), 6)
    b = assemble_rows(tokens, plan, 0, 1, num_rows=3)
    assert b["input_ids"].tolist()[0] == [5, 6, 7, 0, 0]
    assert b["positions"].tolist()[0] == [0, 1, 2, 0, 0]
    assert b["doc_ids"].tolist()[0] == [0, 0, 0, -1, -1]
    assert b["labels"].tolist()[0] == [6, 7, -100, -100, -100]
    for k, pad in (("input_ids", 0), ("positions", 0), ("doc_ids", -1), ("labels", -100)):
        assert (b[k][1:] == pad).all()


def test_assemble_rows_middle_slice_equals_full_slice():
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 258, 5000).astype(np.uint16)
    lens = rng.integers(2, 40, 200)
    starts = np.cumsum(lens) - lens
    plan = plan_rows(rng.permutation(starts), lens, 33)  # shuffled starts, like an epoch
    full = assemble_rows(tokens, plan, 0, plan.num_rows)
    part = assemble_rows(tokens, plan, 5, 9)
    for k in full:
        assert torch.equal(part[k], full[k][5:9])
    assert isinstance(plan, RowPlan)
    # valid label count per row agrees with the tensor
    assert (full["labels"] != IGNORE_INDEX).sum(1).tolist() == plan.label_counts().tolist()
