"""attn_backend = "auto" (issue 12, item 4): the default; flash_attn varlen on CUDA in bf16/fp16
when importable, else flex on CUDA, sdpa on CPU; the chosen kernel gives the logits of sdpa; one
mask per forward serves every layer and loop; the run log names the choice."""

import pytest
import torch
from batches import two_document_batch  # tests/unit/batches.py

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.models.loom import LoomTransformer, loom_flavors
from torchtitan_loom.models.loom.attention import (
    build_attention_mask,
    mask_backend,
    resolve_attn_backend,
)
from torchtitan_loom.trainer import Trainer

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    "device, dtype, flash, want",
    [
        ("cuda", BF16, True, "flash_attn"),
        ("cuda", FP16, True, "flash_attn"),
        ("cuda", FP32, True, "flex"),  # flash-attn takes 16-bit inputs only
        ("cuda", BF16, False, "flex"),  # not installed
        ("cpu", BF16, True, "sdpa"),  # flex has no backward on CPU
        ("cpu", FP32, False, "sdpa"),
    ],
)
def test_auto_resolution(device, dtype, flash, want):
    assert resolve_attn_backend("auto", device, dtype, flash) == want
    assert resolve_attn_backend("flex", device, dtype, flash) == "flex"  # an explicit choice stays


def test_auto_is_the_default_and_masks_name_their_kernel():
    assert loom_flavors["debug"].attn_backend == "auto"
    doc = torch.tensor([[0, 0, 1, 1]])
    assert mask_backend(build_attention_mask("sdpa", doc).kernel) == "sdpa"
    assert mask_backend(build_attention_mask("flex", doc).kernel) == "flex"
    assert mask_backend((torch.tensor([0, 2, 4], dtype=torch.int32), 4)) == "flash_attn"


_batch = two_document_batch


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_auto_gives_the_sdpa_logits_and_one_mask_serves_every_block(dtype):
    auto = LoomTransformer(loom_flavors["debug"])
    sdpa = LoomTransformer(loom_flavors["debug"].replace(attn_backend="sdpa"))
    auto.init_weights()
    sdpa.init_weights()
    masks = []

    def block_region(layer, *args):  # the model's seam: sees each block's mask (its BlockInput)
        masks.append(args[-1].attn_mask)
        return layer(*args)

    auto.region_wrappers["block"] = block_region
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != FP32):
        got, want = auto(*_batch()), sdpa(*_batch())
    assert torch.equal(got.logits_BSV, want.logits_BSV)
    args = auto.args
    assert len(masks) == args.n_layers * args.num_loops and all(m is masks[0] for m in masks)
    assert mask_backend(masks[0].kernel) == "sdpa"


def test_run_log_names_the_backend(tiny_pack, tmp_path, capsys):
    argv = [
        "--data.path",
        str(tiny_pack),
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.seq_len",
        "32",
        "--metrics.enable_tensorboard",
        "false",
        "--eval.interval",
        "0",
    ]
    cfg = load_config(argv)
    Trainer(cfg, resolve(cfg, 1), DistInfo(rank=0, world_size=1, device=torch.device("cpu")))
    assert "attention backend: sdpa (attn_backend=auto)" in capsys.readouterr().out
