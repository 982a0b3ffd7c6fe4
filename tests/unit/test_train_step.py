"""The segmented train step (LOOM_SPEC §6 + §14) on the debug model, checked against autograd by hand."""

import math

import torch

from torchtitan_loom.components.loss import token_ce_sum
from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.protocols import segments
from torchtitan_loom.trainer import Trainer

CPU = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))


def make_trainer(pack_dir, tmp_path, *extra):
    argv = [
        "--data.path",
        str(pack_dir),
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.seq_len",
        "32",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.enable_tensorboard",
        "false",
        "--eval.interval",
        "0",
        "--spike_guard.enable",
        "false",
        "--training.max_norm",
        "0",
        "--model.load_balance_bias_lr",
        "0",
        *extra,
    ]
    cfg = load_config(argv)
    return Trainer(cfg, resolve(cfg, 1), CPU)


def batch_of(trainer):
    return next(iter(trainer.dataloader))


def test_segments_partition_the_loops():
    assert segments(9, 3) == [(1, 3), (4, 6), (7, 9)]
    assert segments(12, 3) == [(1, 3), (4, 6), (7, 9), (10, 12)]
    assert segments(3, 3) == [(1, 3)] and segments(9, 0) == [(1, 9)] and segments(9, 12) == [(1, 9)]
    assert segments(1, 3) == [(1, 1)] and segments(7, 3) == [(1, 3), (4, 6), (7, 7)]


def test_adam_steps_per_segment_and_per_loop_router(tiny_pack, tmp_path):
    tr = make_trainer(
        tiny_pack,
        tmp_path,
        "--model.num_loops",
        "9",
        "--training.bp_segment_len",
        "3",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
    )
    out = tr.train_step(batch_of(tr))
    assert len(out.seg_losses) == 3
    names = dict(tr.model.named_parameters())
    steps = {
        n: int(tr.optimizer.state[p]["step"]) for n, p in names.items() if p in tr.optimizer.state
    }
    routers = [n for n in names if ".moe.routers." in n]
    assert len(routers) == 2 * 9
    assert all(steps[n] == 1 for n in routers)  # router t: only its own segment
    shared = [n for n in names if ".moe.routers." not in n]
    assert all(steps[n] == 3 for n in shared)  # ⌈H/K⌉ AdamW steps for shared weights
    # The routers of different loops start identical and diverge only through their own segment.
    r = [names[f"layers.0.moe.routers.{t}"] for t in range(9)]
    assert not torch.equal(r[0], r[3]) and not torch.equal(r[3], r[6])


def test_last_segment_gradient_equals_autograd_from_detached_carry(tiny_pack, tmp_path):
    # lr = 0 keeps the weights fixed across segments, so the carry of [1,6] can be recomputed.
    tr = make_trainer(
        tiny_pack,
        tmp_path,
        "--model.num_loops",
        "9",
        "--training.bp_segment_len",
        "3",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--optimizer.lr",
        "1e-30",
        "--optimizer.weight_decay",
        "0",
    )
    batch = batch_of(tr)
    tr.train_step(batch)
    got = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    model = tr.model
    model.zero_grad(set_to_none=True)
    n_valid = (batch["labels"] != -100).sum().item()
    for m in (slice(0, 2), slice(2, 4)):
        mb = {k: v[m] for k, v in batch.items()}
        with torch.no_grad():
            carry = model(
                mb["input_ids"], mb["positions"], mb["doc_ids"], loop_start=1, loop_end=6
            ).carry
        out = model(
            mb["input_ids"],
            mb["positions"],
            mb["doc_ids"],
            loop_start=7,
            loop_end=9,
            carry=carry.detach(),
        )
        (token_ce_sum(out.logits_BSV, mb["labels"]) / n_valid).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    assert all(
        ".routers." not in n or n.endswith(tuple(f".routers.{t}" for t in (6, 7, 8))) for n in got
    )
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


def test_one_segment_when_k_covers_all_loops(tiny_pack, tmp_path):
    torch.manual_seed(0)
    a = make_trainer(
        tiny_pack,
        tmp_path,
        "--model.num_loops",
        "3",
        "--training.bp_segment_len",
        "5",
        "--training.global_batch_size",
        "2",
        "--training.micro_batch_size",
        "2",
        "--training.max_norm",
        "1.0",
    )
    batch = batch_of(a)
    a.train_step(batch)
    # A plain full-backprop step written out by hand on an identically initialised model.
    b = make_trainer(
        tiny_pack,
        tmp_path,
        "--model.num_loops",
        "3",
        "--training.bp_segment_len",
        "0",
        "--training.global_batch_size",
        "2",
        "--training.micro_batch_size",
        "2",
    )
    out = b.model(batch["input_ids"], batch["positions"], batch["doc_ids"])
    (token_ce_sum(out.logits_BSV, batch["labels"]) / (batch["labels"] != -100).sum()).backward()
    torch.nn.utils.clip_grad_norm_(b.model.parameters(), 1.0)
    b.optimizer.step()
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=n)


def test_loss_normalisation_independent_of_micro_batching(tiny_pack, tmp_path):
    grads = []
    for micro in ("4", "2"):
        tr = make_trainer(
            tiny_pack,
            tmp_path,
            "--model.num_loops",
            "3",
            "--training.bp_segment_len",
            "0",
            "--training.global_batch_size",
            "4",
            "--training.micro_batch_size",
            micro,
            "--model.capacity_factor",
            "0",
            "--optimizer.lr",
            "1e-30",
        )
        tr.train_step(batch_of(tr))
        grads.append(
            {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
        )
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=0, atol=1e-6, msg=n)


def test_expert_bias_update_once_per_step_from_counts(tiny_pack, tmp_path):
    tr = make_trainer(
        tiny_pack,
        tmp_path,
        "--model.num_loops",
        "3",
        "--training.bp_segment_len",
        "1",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--model.load_balance_bias_lr",
        "0.5",
    )
    out = tr.train_step(batch_of(tr))
    load_LE = out.counts_LHE.sum(1).double()
    for layer, load_E in zip(tr.model.moe_layers(), load_LE):
        want = 0.5 * torch.sign(load_E.mean() - load_E)
        torch.testing.assert_close(layer.expert_bias.double(), want)
    # Counts cover every loop of every micro-batch: k routed assignments per token before dropping.
    args = tr.model_args
    k = args.top_k - (args.num_shared_experts if args.top_k_includes_shared else 0)
    assert int(out.counts_LHE[0].sum()) <= 4 * 32 * k * 3
    assert (out.counts_LHE.sum(-1) > 0).all()


def test_skipped_segment_discards_bias_update_and_later_segments(tiny_pack, tmp_path):
    tr = make_trainer(
        tiny_pack,
        tmp_path,
        "--model.num_loops",
        "3",
        "--training.bp_segment_len",
        "1",
        "--training.global_batch_size",
        "2",
        "--training.micro_batch_size",
        "2",
        "--spike_guard.enable",
        "true",
        "--model.load_balance_bias_lr",
        "0.5",
    )
    batch = batch_of(tr)
    assert tr.train_step(batch).skip_reason is None  # first sight of each segment: accepted
    for _ in range(300):  # drive segment 1's baseline to ~0
        tr.spike_guard.accept(0, 0.0)
    params = {n: p.clone() for n, p in tr.model.named_parameters()}
    biases = [m.expert_bias.clone() for m in tr.model.moe_layers()]
    out = tr.train_step(batch)
    assert out.skip_reason.startswith("segment 1 (loops 1-1)")
    assert len(out.seg_losses) == 1  # segments 2 and 3 abandoned
    assert out.grad_norm is None  # no segment stepped: no norm, never a NaN
    for n, p in tr.model.named_parameters():
        assert torch.equal(p, params[n]), n  # no optimizer step at all
    for m, b in zip(tr.model.moe_layers(), biases):
        assert torch.equal(m.expert_bias, b)  # bias update discarded


def test_grad_norm_is_that_of_the_last_segment_that_stepped(tiny_pack, tmp_path):
    tr = make_trainer(
        tiny_pack,
        tmp_path,
        "--model.num_loops",
        "3",
        "--training.bp_segment_len",
        "1",
        "--training.global_batch_size",
        "2",
        "--training.micro_batch_size",
        "2",
        "--spike_guard.enable",
        "true",
    )
    batch = batch_of(tr)
    tr.train_step(batch)
    for _ in range(300):  # only segment 2's baseline goes to ~0
        tr.spike_guard.accept(1, 0.0)
    out = tr.train_step(batch)
    assert out.skip_reason.startswith("segment 2 (loops 2-2)") and len(out.seg_losses) == 2
    assert out.grad_norm is not None and math.isfinite(out.grad_norm) and out.grad_norm > 0
