"""model.vocab_size against the pack's tokenizer (a 49,152-id pack, the SmolLM tokenizer's size,
trains on the debug flavor with one override), and checkpoint.async_mode async_with_pinned_mem."""

import numpy as np
import pytest
import torch

from torchtitan_loom.components.checkpoint import tree
from torchtitan_loom.components.data.pack_writer import PackWriter
from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.trainer import Trainer

CPU = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))
SMOLLM_VOCAB = 49_152


@pytest.fixture(scope="module")
def pack_49152(tmp_path_factory):
    """A made-up tokenizer of 49,152 ids: documents of random ids that use the top of the range."""
    out = tmp_path_factory.mktemp("packs") / "v49152"
    rng = np.random.default_rng(0)
    info = {"vocab_size": SMOLLM_VOCAB, "name_or_path": "made-up-49152", "eos_token_id": 0}
    with PackWriter(out, info, max_seq_len=33) as w:
        for _ in range(400):
            w.add_document(
                rng.integers(SMOLLM_VOCAB - 300, SMOLLM_VOCAB, size=int(rng.integers(5, 60)))
            )
        w.finish(epochs=1, holdout_tokens=500, seed=0)
    return out


def _argv(pack, dump, *extra):
    return [
        "--data.path",
        str(pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--training.steps",
        "3",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--eval.interval",
        "3",
        "--eval.tokens",
        "200",
        "--metrics.enable_tensorboard",
        "false",
        *extra,
    ]


def test_flavor_vocab_smaller_than_the_tokenizer_names_the_override(pack_49152, tmp_path):
    with pytest.raises(ConfigError) as err:
        resolve(load_config(_argv(pack_49152, tmp_path)), 1)
    assert str(err.value) == (
        f"model.vocab_size = 512 (from the flavor 'debug') is smaller than the tokenizer of "
        f"data.path='{pack_49152}' (49,152 ids); set --model.vocab_size 49152 (its size "
        f"rounded up to a multiple of 256)"
    )
    with pytest.raises(
        ConfigError,
        match=r"model.vocab_size = 40000 \(from model.vocab_size\).*--model.vocab_size "
        r"49152",
    ):
        resolve(load_config(_argv(pack_49152, tmp_path, "--model.vocab_size", "40000")), 1)


def test_a_49152_vocab_pack_trains_on_debug_with_one_override(pack_49152, tmp_path):
    cfg = load_config(_argv(pack_49152, tmp_path, "--model.vocab_size", "49152"))
    trainer = Trainer(cfg, resolve(cfg, 1), CPU)
    assert trainer.model.tok_embeddings.weight.shape[0] == SMOLLM_VOCAB
    assert trainer.train() == 0
    rows = [
        __import__("json").loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    # Starts near ln(49,152) ≈ 10.8 (a uniform guess over the vocabulary) and learns the 300-id range.
    assert (
        rows[0]["loss"] > 9.0
        and np.isfinite(rows[-1]["eval_loss"])
        and rows[-1]["loss"] < rows[0]["loss"]
    )


def test_async_with_pinned_mem_reuses_one_stager_and_saves_exactly(pack_49152, tmp_path):
    extra = (
        "--model.vocab_size",
        "49152",
        "--eval.interval",
        "0",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.async_mode",
        "async_with_pinned_mem",
    )
    cfg = load_config(_argv(pack_49152, tmp_path, *extra))
    t1 = Trainer(cfg, resolve(cfg, 1), CPU)
    stager = t1.checkpointer.stager
    assert stager is not None
    t1.resume()
    t1.train()  # saves steps 1, 2, 3 through the same stager; close() commits the last one
    assert (
        t1.checkpointer.stager is None
        and tree.scan(str(tmp_path / "checkpoint")).newest().step == 3
    )
    expected = {k: v.clone() for k, v in t1.model.state_dict().items()}
    # run.json says finished: load_step is how a finished run is opened again.
    cfg2 = load_config(_argv(pack_49152, tmp_path, *extra, "--checkpoint.load_step", "3"))
    t2 = Trainer(cfg2, resolve(cfg2, 1), CPU)
    t2.resume()
    assert t2.state.step == 3
    for k, v in expected.items():
        assert torch.equal(v, t2.model.state_dict()[k]), k
    # Staging finished before save() returned: changing the weights right after must not leak in.
    t2.checkpointer.save(4)
    with torch.no_grad():
        for p in t2.model.parameters():
            p.add_(1.0)
    t2.checkpointer.close()
    cfg3 = load_config(_argv(pack_49152, tmp_path, *extra))
    t3 = Trainer(cfg3, resolve(cfg3, 1), CPU)
    t3.resume()
    for k, v in expected.items():
        assert torch.equal(v, t3.model.state_dict()[k]), k
