"""Tokenizers: byte-level, Hugging Face tokenizer.json (trained here), selection and errors."""

import json
import sys

import numpy as np
import pytest

from torchtitan_loom.components.data import PackWriter, build_train_loader, open_pack
from torchtitan_loom.components.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
    same_tokenizer_name,
)

TEXTS = [
    "the cat sat on the mat",
    "a dog ran to the park",
    "the quick brown fox",
    "héllo wörld",
] * 20


def test_byte_tokenizer_ids_and_round_trip():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.name_or_path) == (258, 256, 257, "byte")
    ids = tok.encode("hé!")
    assert ids == [104, 0xC3, 0xA9, 33]
    assert tok.encode_array("hé!").tolist() == ids and tok.encode_array("x").dtype == np.int64
    assert tok.decode(ids + [256, 257]) == "hé!"  # specials dropped
    with pytest.raises(ValueError, match="fixed EOS"):
        build_tokenizer("byte", eos_token="</s>")


def test_unknown_tokenizer_name_is_a_clear_error(tmp_path):
    with pytest.raises(
        ValueError, match="'gpt9'.*valid values are 'byte', a path to a tokenizer.json"
    ):
        build_tokenizer("gpt9")
    with pytest.raises(ValueError, match="no such file"):
        build_tokenizer(tmp_path)  # a directory without tokenizer.json


def test_missing_tokenizers_package_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match=r"pip install torchtitan_loom\[data\]"):
        build_tokenizer(tmp_path / "tokenizer.json")


def test_same_tokenizer_name():
    assert same_tokenizer_name("byte", "byte")
    assert same_tokenizer_name("/a/SmolLM/tokenizer.json", "HuggingFaceTB/SmolLM/")
    assert not same_tokenizer_name("byte", "/a/SmolLM")


def train_hf(tmp_path, specials=("<|endoftext|>", "<pad>")):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS, trainer)
    d = tmp_path / "mytok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return d


def test_hf_tokenizer_round_trip_and_eos_guess(tmp_path):
    d = train_hf(tmp_path)
    tok = build_tokenizer(d)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == 0 and tok.pad_id == 1  # specials come first in the trained vocab
    assert tok.vocab_size == HFTokenizer(d / "tokenizer.json").vocab_size <= 300
    ids = tok.encode("the cat sat on the park")
    assert len(ids) < len("the cat sat on the park")  # merges were learnt
    assert tok.decode(ids) == "the cat sat on the park"
    assert tok.encode_array("the cat").tolist() == tok.encode("the cat")
    assert build_tokenizer(d, eos_token="<pad>").eos_id == 1
    with pytest.raises(ValueError, match="eos token '<nope>' is not in its vocabulary"):
        build_tokenizer(d, eos_token="<nope>")


def test_hf_eos_from_tokenizer_config_or_clear_error(tmp_path):
    d = train_hf(tmp_path, specials=("<s>", "<end>"))
    with pytest.raises(ValueError, match="cannot guess the end-of-text token.*--eos-token"):
        build_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<end>"}}))
    assert build_tokenizer(d).eos_id == 1


def test_hf_tokenizer_pack_reads_back(tmp_path):
    d = train_hf(tmp_path)
    tok = build_tokenizer(d)
    info = {"vocab_size": tok.vocab_size, "name_or_path": str(d), "eos_token_id": tok.eos_id}
    with PackWriter(tmp_path / "pack", info, 33) as w:
        for t in TEXTS[:8]:
            w.add_document(tok.encode_array(t))
        w.finish(epochs=1, holdout_tokens=0)
    pack = open_pack(
        tmp_path / "pack", seq_len=32, vocab_size=512, tokenizer_name=str(d / "tokenizer.json")
    )
    assert pack.eos_id == tok.eos_id
    rows = next(
        iter(
            build_train_loader(
                tmp_path / "pack", 32, 512, global_batch_rows=2, dp_rank=0, dp_world=1
            )
        )
    )
    docs = []
    for inp, doc in zip(rows["input_ids"], rows["doc_ids"]):
        docs += [tok.decode(inp[doc == k].tolist()) for k in sorted(set(doc.tolist()) - {-1})]
    assert sorted(docs) == sorted(TEXTS[:8])  # every document comes back intact
