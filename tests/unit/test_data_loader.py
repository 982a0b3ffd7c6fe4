"""Train loader: world-size independence, resume, epoch roll-over; eval loader."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_loom.components.data import (
    IGNORE_INDEX,
    PackWriter,
    build_eval_loader,
    build_train_loader,
    open_pack,
)
from torchtitan_loom.components.data.rows import assemble_rows, plan_rows
from torchtitan_loom.components.data.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]
S = 15  # model sequence length; records of up to 16 tokens
BYTE_INFO = {"vocab_size": 258, "name_or_path": "byte", "eos_token_id": 256}


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    """Lower-case training documents of varied length; the holdout (last docs) is all 'Z'."""
    rng = np.random.default_rng(1)
    tok = ByteTokenizer()
    out = tmp_path_factory.mktemp("packs") / "p"
    with PackWriter(out, BYTE_INFO, S + 1) as w:
        for _ in range(150):
            w.add_document(
                tok.encode_array(
                    "".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(1, 25)))
                )
            )
        for _ in range(8):
            w.add_document(tok.encode_array("Z" * 9))
        w.finish(epochs=2, holdout_tokens=80, seed=0)
    return out


def cat_ranks(batches):
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def assert_batch_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def rank_loaders(path, G, W, **kw):
    return [
        build_train_loader(
            path, seq_len=S, vocab_size=258, global_batch_rows=G, dp_rank=r, dp_world=W, **kw
        )
        for r in range(W)
    ]


def global_batches(loaders, n):
    its = [iter(ld) for ld in loaders]
    return [cat_ranks([next(it) for it in its]) for _ in range(n)]


def expected_global(path, orderings, G):
    """Global batches by definition: each pass packs its ordering, takes whole G-row batches."""
    pack = open_pack(path, S, 258)
    out = []
    for k in orderings:
        plan = plan_rows(*pack.records(k), S + 1)
        for lo in range(0, plan.num_rows - G + 1, G):
            out.append(assemble_rows(pack.tokens, plan, lo, lo + G))
    return out


def test_loader_is_a_stateful_dataloader_with_contract_batches(pack_dir):
    ld = build_train_loader(
        pack_dir, seq_len=S, vocab_size=258, global_batch_rows=4, dp_rank=1, dp_world=2
    )
    assert isinstance(ld, StatefulDataLoader)
    b = next(iter(ld))
    assert set(b) == {"input_ids", "labels", "positions", "doc_ids"}
    assert all(v.shape == (2, S) and v.dtype == torch.int64 for v in b.values())
    assert ld.state_dict() == {"epoch": 0, "cursor": 4, "global_batch_rows": 4, "seq_len": S}


def test_same_global_batches_for_every_world_size(pack_dir):
    G, n = 4, 12
    ref = expected_global(pack_dir, [0], G)[:n]
    for W in (1, 2, 4):
        got = global_batches(rank_loaders(pack_dir, G, W), n)
        for a, b in zip(got, ref):
            assert_batch_equal(a, b)


def test_state_saved_at_w4_loads_at_w2(pack_dir):
    G, n = 8, 5
    ref = global_batches(rank_loaders(pack_dir, G, 1), n + 3)
    w4 = rank_loaders(pack_dir, G, 4)
    global_batches(w4, n)
    states = [ld.state_dict() for ld in w4]
    assert all(s == states[0] for s in states)  # W-independent: every rank holds the same state
    w2 = rank_loaders(pack_dir, G, 2)
    for ld in w2:
        ld.load_state_dict(states[0])
    for a, b in zip(global_batches(w2, 3), ref[n:]):
        assert_batch_equal(a, b)


def test_resume_mid_epoch_gives_the_same_next_batches(pack_dir):
    a = build_train_loader(pack_dir, S, 258, 4, 0, 1)
    it = iter(a)
    for _ in range(5):
        next(it)
    sd = a.state_dict()
    following = [next(it) for _ in range(4)]
    b = build_train_loader(pack_dir, S, 258, 4, 0, 1)
    b.load_state_dict(sd)
    for x, y in zip(following, [next(iter(b)) for _ in range(4)]):  # each iter() continues
        assert_batch_equal(x, y)


def test_roll_over_cycles_training_orderings_and_never_reads_holdout(pack_dir):
    pack = open_pack(pack_dir, S, 258)
    assert pack.training_epochs == (0, 1) and pack.holdout_epoch == 2
    G = 8
    ref = expected_global(pack_dir, [0, 1, 0], G)
    per_pass = [plan_rows(*pack.records(k), S + 1).num_rows // G for k in (0, 1)]
    ld = build_train_loader(pack_dir, S, 258, G, 0, 1)
    got = global_batches([ld], len(ref))
    for a, b in zip(got, ref):
        assert_batch_equal(a, b)
        assert not (a["input_ids"] == ord("Z")).any()  # holdout tokens never trained on
    assert ld.state_dict()["epoch"] == 2 and ld.state_dict()["cursor"] == per_pass[0] * G
    assert not torch.equal(
        ref[0]["input_ids"], ref[per_pass[0]]["input_ids"]
    )  # pass 2 uses epoch_1


def test_load_state_with_other_batch_or_seq_len_fails(pack_dir):
    ld = build_train_loader(pack_dir, S, 258, 4, 0, 1)
    with pytest.raises(
        ValueError, match="global_batch_rows=8 but this run uses global_batch_rows=4"
    ):
        ld.load_state_dict({"epoch": 0, "cursor": 8, "global_batch_rows": 8, "seq_len": S})
    with pytest.raises(ValueError, match="seq_len=31 but this run uses seq_len=15"):
        ld.load_state_dict({"epoch": 0, "cursor": 8, "global_batch_rows": 4, "seq_len": 31})
    with pytest.raises(ValueError, match="lacks"):
        ld.load_state_dict({"cursor": 8})


def test_bad_rank_arguments(pack_dir):
    with pytest.raises(ValueError, match="multiple of the data-parallel world size 4"):
        build_train_loader(pack_dir, S, 258, 6, 0, 4)
    with pytest.raises(ValueError, match="dp_rank 2 / dp_world 2"):
        build_train_loader(pack_dir, S, 258, 4, 2, 2)
    with pytest.raises(ValueError, match="fewer than global_batch_rows 100000"):
        build_train_loader(pack_dir, S, 258, 100000, 0, 1)


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_give_same_batches_and_exact_resume(pack_dir, workers):
    ref = global_batches([build_train_loader(pack_dir, S, 258, 4, 0, 1)], 9)
    ld = build_train_loader(pack_dir, S, 258, 4, 0, 1, num_workers=workers)
    it = iter(ld)
    got = [next(it) for _ in range(5)]  # workers have prefetched beyond batch 5 by now
    sd = ld.state_dict()
    del it
    for a, b in zip(got, ref):
        assert_batch_equal(a, b)
    assert sd["cursor"] == 5 * 4
    resumed = build_train_loader(pack_dir, S, 258, 4, 0, 1, num_workers=workers)
    resumed.load_state_dict(sd)
    it = iter(resumed)
    for b in ref[5:]:
        assert_batch_equal(next(it), b)


def test_eval_reads_holdout_in_order_and_pads_last_batch(pack_dir):
    pack = open_pack(pack_dir, S, 258)
    plan = plan_rows(*pack.records(2), S + 1)
    batches = [
        list(build_eval_loader(pack_dir, S, 258, batch_rows=4, dp_rank=r, dp_world=2))
        for r in (0, 1)
    ]
    assert len(batches[0]) == len(batches[1]) == -(-plan.num_rows // 4)
    full = torch.cat([torch.cat([a["input_ids"], b["input_ids"]]) for a, b in zip(*batches)])
    ref = assemble_rows(pack.tokens, plan, 0, plan.num_rows)["input_ids"]
    assert torch.equal(full[: plan.num_rows], ref)
    assert (full[plan.num_rows :] == 0).all()  # padding rows
    assert set(full[full != 0].tolist()) <= {ord("Z"), 256}  # holdout docs only
    again = list(build_eval_loader(pack_dir, S, 258, 4, 0, 2))
    assert all(
        torch.equal(a["labels"], b["labels"]) for a, b in zip(again, batches[0])
    )  # fixed order


def test_eval_stops_after_max_tokens_counted_globally(pack_dir):
    ev1 = build_eval_loader(pack_dir, S, 258, batch_rows=2, dp_rank=0, dp_world=1, max_tokens=20)
    ev2 = [
        build_eval_loader(pack_dir, S, 258, batch_rows=2, dp_rank=r, dp_world=2, max_tokens=20)
        for r in (0, 1)
    ]
    # each holdout row holds one 'Z'*9+EOS record = 9 labels; 18 after batch 1, 36 after batch 2
    assert len(ev1) == len(ev2[0]) == len(ev2[1]) == 2 and ev1.num_label_tokens == 36
    labels = sum(int((b["labels"] != IGNORE_INDEX).sum()) for ld in ev2 for b in ld)
    assert labels == 36


def test_eval_on_separate_val_pack_reads_its_epoch_0(pack_dir, tmp_path):
    tok = ByteTokenizer()
    with PackWriter(tmp_path / "val", BYTE_INFO, S + 1) as w:
        for i in range(5):
            w.add_document(tok.encode_array(f"val{i}"))
        w.finish(epochs=1, holdout_tokens=0)
    ev = list(build_eval_loader(pack_dir, S, 258, 4, 0, 1, val_path=tmp_path / "val"))
    text = tok.decode(torch.cat([b["input_ids"] for b in ev]).flatten().tolist())
    val = open_pack(tmp_path / "val", S, 258)
    assert sorted(text.replace("\x00", "").split("val")[1:]) == list("01234")
    assert val.holdout_epoch is None
    with pytest.raises(ValueError, match="has no holdout epoch"):
        build_eval_loader(tmp_path / "val", S, 258, 4, 0, 1)


def test_loader_without_torchdata_gives_the_same_batches_and_state(pack_dir, tmp_path):
    # The GPU image has no torchdata: the loader falls back to torch's DataLoader (its state is its own).
    script = tmp_path / "no_torchdata.py"
    script.write_text(
        "import sys\n"
        "sys.modules['torchdata'] = sys.modules['torchdata.stateful_dataloader'] = None  # import fails\n"
        "import torch\n"
        "from torchtitan_loom.components.data import build_train_loader\n"
        f"ld = build_train_loader({str(pack_dir)!r}, seq_len={S}, vocab_size=258, global_batch_rows=4,"
        " dp_rank=0, dp_world=1)\n"
        "assert type(ld).__mro__[1] is torch.utils.data.DataLoader, type(ld).__mro__\n"
        "it = iter(ld)\n"
        "batches = [next(it)['input_ids'] for _ in range(3)]\n"
        "torch.save({'batches': batches, 'state': ld.state_dict()}, sys.argv[1])\n"
    )
    out = tmp_path / "out.pt"
    subprocess.run(
        [sys.executable, str(script), str(out)],
        check=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    got = torch.load(out)
    ld = build_train_loader(
        pack_dir, seq_len=S, vocab_size=258, global_batch_rows=4, dp_rank=0, dp_world=1
    )
    it = iter(ld)
    want = [next(it)["input_ids"] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got["batches"], want))
    assert (
        got["state"]
        == ld.state_dict()
        == {"epoch": 0, "cursor": 12, "global_batch_rows": 4, "seq_len": S}
    )
