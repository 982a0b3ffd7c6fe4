"""Pack format: write → read round trip, the reference layout, and every validation error."""

import json
import shutil

import numpy as np
import pytest
import torch

from torchtitan_loom.components.data import (
    IGNORE_INDEX,
    PackError,
    PackWriter,
    build_eval_loader,
    build_train_loader,
    open_pack,
)
from torchtitan_loom.components.data.rows import plan_rows
from torchtitan_loom.components.data.tokenizer import ByteTokenizer

BYTE_INFO = {"vocab_size": 258, "name_or_path": "byte", "eos_token_id": 256}


def write_texts(out, texts, max_seq_len, epochs=2, holdout_tokens=0, seed=0):
    tok = ByteTokenizer()
    with PackWriter(out, BYTE_INFO, max_seq_len) as w:
        for t in texts:
            w.add_document(tok.encode_array(t))
        return w.finish(epochs=epochs, holdout_tokens=holdout_tokens, seed=seed)


def expected_records(texts, C):
    """Each text + EOS cut into chunks of C tokens; a final chunk under 2 tokens is dropped."""
    recs = []
    for t in texts:
        ids = list(t.encode()) + [256]
        recs += [ids[i : i + C] for i in range(0, len(ids), C) if len(ids[i : i + C]) >= 2]
    return recs


def segments(batch):
    """Records read back from batch tensors: the inputs of each doc id plus its final label."""
    out = []
    for inp, lab, pos, doc in zip(
        batch["input_ids"], batch["labels"], batch["positions"], batch["doc_ids"]
    ):
        for d in sorted(set(doc.tolist()) - {-1}):
            m = doc == d
            ids, labs, p = inp[m].tolist(), lab[m].tolist(), pos[m].tolist()
            assert p == list(range(len(p)))  # positions restart per record
            assert labs[:-1] == ids[1:]  # labels are the next tokens
            out.append(ids + ([labs[-1]] if labs[-1] != IGNORE_INDEX else []))
    return out


def test_round_trip_reproduces_every_record_exactly(tmp_path):
    rng = np.random.default_rng(0)
    texts = [
        "".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(0, 30))) for _ in range(60)
    ]
    texts[5] = "x"  # → 'x' + EOS: 2 tokens, kept
    pack_dir = write_texts(tmp_path / "p", texts, max_seq_len=9, epochs=1)
    pack = open_pack(pack_dir, seq_len=8, vocab_size=258, tokenizer_name="byte")
    assert pack.tokens.dtype == np.uint16
    exp = expected_records(texts, 9)
    # the token stream is the records in corpus order
    assert pack.tokens.tolist() == [t for r in exp for t in r]
    starts, lens = pack.records(0)
    loader = build_train_loader(
        pack_dir, seq_len=8, vocab_size=258, global_batch_rows=1, dp_rank=0, dp_world=1
    )
    rows_per_epoch = plan_rows(starts, lens, 9).num_rows
    it = iter(loader)
    got = []
    for _ in range(rows_per_epoch):
        got += segments(next(it))
    # one epoch of rows = every record once, in the stored (shuffled) order
    assert got == [pack.tokens[s : s + n].tolist() for s, n in zip(starts, lens)]
    assert sorted(got) == sorted(exp)


def test_long_records_split_when_model_seq_len_is_shorter(tmp_path):
    texts = ["abcdefghijklmnopqrstuvwxyz" * 2]  # 53 tokens → records of 16,16,16,5
    pack_dir = write_texts(tmp_path / "p", texts, max_seq_len=16, epochs=1)
    loader = build_train_loader(
        pack_dir, seq_len=7, vocab_size=258, global_batch_rows=7, dp_rank=0, dp_world=1
    )
    got = segments(next(iter(loader)))
    ids = list(texts[0].encode()) + [256]
    # each 16-token record becomes 2 pieces of 8 (S+1), in the stored order; the 5-token one stays
    pack = open_pack(pack_dir, 7, 258)
    exp = []
    for s, n in zip(*pack.records(0)):
        cuts = [(s, n)] if n == 5 else [(s, 8), (s + 8, 8)]
        exp += [pack.tokens[a : a + m].tolist() for a, m in cuts]
    assert got == exp
    assert sorted(got) == sorted([ids[i : i + 8] for i in range(0, 48, 8)] + [ids[48:]])


def test_holdout_is_last_records_in_corpus_order(tmp_path):
    texts = [f"doc{i:02d}" for i in range(40)]
    pack_dir = write_texts(tmp_path / "p", texts, max_seq_len=32, epochs=3, holdout_tokens=12)
    meta = json.loads((pack_dir / "metadata.json").read_text())
    assert meta["holdout_epoch"] == 3 and meta["holdout_records"] == 2  # 6 tokens per doc
    assert meta["layout"] == "document" and meta["max_seq_len"] == 32
    assert meta["tokenizer_info"] == BYTE_INFO and meta["total_length"] == 40 * 6
    pack = open_pack(pack_dir, 31, 258)
    assert pack.training_epochs == (0, 1, 2) and pack.holdout_epoch == 3
    hs, hl = pack.records(3)
    assert [ByteTokenizer().decode(pack.tokens[s : s + n]) for s, n in zip(hs, hl)] == [
        "doc38",
        "doc39",
    ]
    for k in range(3):
        s, n = pack.records(k)
        assert sorted(s.tolist()) == list(range(0, 38 * 6, 6))  # a permutation of training records
        assert np.load(pack_dir / f"epoch_{k}" / "doc_start.npy").dtype == np.int64
        assert np.load(pack_dir / f"epoch_{k}" / "doc_len.npy").dtype == np.int32
    assert not np.array_equal(pack.records(0)[0], pack.records(1)[0])  # independent orderings


def write_reference_pack(d, tokens, records, holdout, extra_meta=None, max_seq_len=8, vocab=258):
    """By hand, the reference packer's layout: uint16 tokens, int64 starts, int32 lengths,
    epoch_0..epoch_8 training orderings and epoch_9 = holdout, no holdout_epoch key."""
    d.mkdir()
    np.save(d / "tokens.npy", np.asarray(tokens, np.uint16))
    for k in range(10):
        recs = holdout if k == 9 else records[k % len(records) :] + records[: k % len(records)]
        (d / f"epoch_{k}").mkdir()
        np.save(d / f"epoch_{k}" / "doc_start.npy", np.array([s for s, _ in recs], np.int64))
        np.save(d / f"epoch_{k}" / "doc_len.npy", np.array([n for _, n in recs], np.int32))
    meta = {
        "tokenizer_info": {"vocab_size": vocab, "name_or_path": "byte", "eos_token_id": 256},
        "max_seq_len": max_seq_len,
        "total_length": len(tokens),
        "layout": "document",
        **(extra_meta or {}),
    }
    (d / "metadata.json").write_text(json.dumps(meta))
    return d


def test_reference_layout_pack_loads_with_epoch_9_as_holdout(tmp_path):
    tokens = list(range(1, 41))
    records = [(0, 4), (4, 8), (12, 3), (15, 5), (20, 8), (28, 4)]
    holdout = [(32, 8)]
    d = write_reference_pack(tmp_path / "ref", tokens, records, holdout)
    pack = open_pack(d, seq_len=7, vocab_size=258, tokenizer_name="byte")
    assert pack.training_epochs == tuple(range(9)) and pack.holdout_epoch == 9
    train = next(iter(build_train_loader(d, 7, 258, global_batch_rows=2, dp_rank=0, dp_world=1)))
    assert segments(train) == [tokens[0:4], tokens[4:12]]  # epoch_0, rows: [4], [8]
    ev = list(build_eval_loader(d, 7, 258, batch_rows=2, dp_rank=0, dp_world=1))
    assert len(ev) == 1 and segments(ev[0]) == [tokens[32:40]]
    assert (ev[0]["doc_ids"][1] == -1).all()  # the missing second row is padding


@pytest.fixture
def good_pack(tmp_path):
    return write_texts(
        tmp_path / "good",
        [f"document number {i}" for i in range(30)],
        max_seq_len=16,
        epochs=2,
        holdout_tokens=20,
    )


def damaged(good_pack, tmp_path, edit):
    d = tmp_path / "bad"
    shutil.copytree(good_pack, d)
    edit(d)
    return d


def _set_meta(d, **kv):
    meta = json.loads((d / "metadata.json").read_text())
    meta.update(kv)
    (d / "metadata.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "edit,pattern",
    [
        (lambda d: (d / "metadata.json").unlink(), "metadata.json is missing"),
        (lambda d: (d / "tokens.npy").unlink(), "tokens.npy is missing"),
        (lambda d: (d / "epoch_1" / "doc_len.npy").unlink(), r"epoch_1/doc_len.npy is missing"),
        (lambda d: [shutil.rmtree(d / f"epoch_{k}") for k in range(3)], "no epoch_k directories"),
        (
            lambda d: np.save(d / "epoch_0" / "doc_len.npy", np.ones(3, np.int32)),
            "doc_start entries but 3 doc_len",
        ),
        (
            lambda d: np.save(
                d / "epoch_0" / "doc_start.npy", np.load(d / "epoch_0" / "doc_start.npy") + 10_000
            ),
            "lies outside tokens.npy",
        ),
        (lambda d: _set_meta(d, total_length=5), "total_length 5"),
        (lambda d: _set_meta(d, layout="flat"), "layout is 'flat'"),
        (lambda d: _set_meta(d, holdout_epoch=7), "holdout_epoch 7 has no epoch_7"),
        (lambda d: _set_meta(d, max_token_id=300), "token id 300 is ≥ the model vocab_size 258"),
    ],
)
def test_each_damage_gives_one_clear_error(good_pack, tmp_path, edit, pattern):
    bad = damaged(good_pack, tmp_path, edit)
    with pytest.raises(PackError, match=pattern) as e:
        open_pack(bad, seq_len=15, vocab_size=258)
    assert str(bad) in str(e.value)


def test_seq_len_vocab_and_tokenizer_disagreements(good_pack):
    open_pack(good_pack, seq_len=15, vocab_size=258, tokenizer_name="byte")  # fine
    with pytest.raises(PackError, match=r"seq_len 16 .* valid seq_len is 1\.\.15"):
        open_pack(good_pack, seq_len=16, vocab_size=258)
    with pytest.raises(PackError, match="EOS id 256 is outside the model vocabulary of 200"):
        open_pack(good_pack, seq_len=15, vocab_size=200)
    with pytest.raises(
        PackError, match="tokenised with 'byte', the config asks for '/x/gpt2/tokenizer.json'"
    ):
        open_pack(good_pack, seq_len=15, vocab_size=258, tokenizer_name="/x/gpt2/tokenizer.json")
    with pytest.raises(PackError, match="no such directory"):
        open_pack(good_pack / "nope", seq_len=15, vocab_size=258)


def test_token_ids_beyond_vocab_found_by_scan(tmp_path):
    """A reference pack records no max_token_id, so open_pack scans the stream."""
    d = write_reference_pack(
        tmp_path / "ref", [1, 2, 3, 900, 5, 6, 7, 8], [(0, 4)], [(4, 4)], vocab=1000
    )
    with pytest.raises(PackError, match="token id 900 is ≥ the model vocab_size 512"):
        open_pack(d, seq_len=7, vocab_size=512)
    assert open_pack(d, seq_len=7, vocab_size=1024).tokens.max() == 900


def test_pack_with_large_vocab_uses_uint32(tmp_path):
    info = {"vocab_size": 70_000, "name_or_path": "big", "eos_token_id": 69_999}
    with PackWriter(tmp_path / "p", info, 8) as w:
        w.add_document(np.array([65_600, 3, 4]))
        w.add_document(np.array([7, 8]))
        d = w.finish(epochs=1, holdout_tokens=0)
    pack = open_pack(d, seq_len=7, vocab_size=70_016)
    assert pack.tokens.dtype == np.uint32 and pack.tokens.tolist() == [
        65_600,
        3,
        4,
        69_999,
        7,
        8,
        69_999,
    ]
    with pytest.raises(ValueError, match="token ids must lie in 0..69999"):
        with PackWriter(tmp_path / "q", info, 8) as w:
            w.add_document(np.array([70_000]))
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q.tmp-*"))  # temp dir removed


def test_writer_refuses_existing_output_and_cleans_up(tmp_path, good_pack):
    with pytest.raises(FileExistsError, match="already exists"):
        write_texts(good_pack, ["abc"] * 20, max_seq_len=8)
    assert not list(good_pack.parent.glob(".good.tmp-*"))
    assert open_pack(good_pack, 15, 258).max_seq_len == 16  # untouched
    batch = next(iter(build_train_loader(good_pack, 15, 258, 2, 0, 1)))
    assert torch.is_tensor(batch["input_ids"])
