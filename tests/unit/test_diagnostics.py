"""Branch diagnostics of the training step (components/observability/diagnostics.py): every statistic equals a
direct computation on the same activations (captured by forward hooks on the branch modules,
rank collapse from singular values of the sample rows), the per-submodule gradient norms equal
the gradients left after the step, the key set comes from the shapes alone, and a skipped segment
leaves its loops null rather than zero."""

import math

import pytest
import torch
from rank_collapse_ref import direct_rank_collapse  # next to this file

from torchtitan_loom.components.observability.diagnostics import (
    RANK_SAMPLE_ROWS,
    rank_collapse,
    sample_rows,
)
from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
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
        "--metrics.enable_tensorboard",
        "false",
        "--eval.interval",
        "0",
        "--model.num_loops",
        "3",
        "--training.bp_segment_len",
        "2",
        "--training.max_norm",
        "0",
        "--training.global_batch_size",
        "8",
        "--training.micro_batch_size",
        "4",
        "--training.mixed_precision_param",
        "float32",
        "--activation_checkpoint.mode",
        "none",
        "--metrics.diag_interval",
        "1",
        "--metrics.diag_grad",
        "true",
        *extra,
    ]
    cfg = load_config(argv)
    return Trainer(cfg, resolve(cfg, 1), CPU)


def capture_branches(model):
    """Forward hooks on every layer's attention and MoE module: their outputs, in call order."""
    seen = []
    handles = []
    for layer in model.layers:
        handles.append(
            layer.attention.register_forward_hook(
                lambda mod, args, out, l=layer: seen.append(("attention", out.detach().clone()))
            )
        )
        handles.append(
            layer.moe.register_forward_hook(
                lambda mod, args, out: seen.append(("moe", out[0].detach().clone()))
            )
        )
    return seen, handles


def test_every_statistic_equals_a_direct_computation(tiny_pack, tmp_path):
    tr = make_trainer(tiny_pack, tmp_path)
    L, _H = tr.model.args.n_layers, tr.model.num_loops
    seen, handles = capture_branches(tr.model)
    batch = next(iter(tr.dataloader))
    valid = [v.reshape(-1) >= 0 for v in batch["doc_ids"].split(4)]  # padding has doc id -1
    assert not all(v.all() for v in valid)  # the tiny pack pads: the statistics must leave it out
    out = tr.train_step(batch)
    for h in handles:
        h.remove()
    assert out.diag is not None and set(out.diag) == set(tr.parts.training.diagnostics.keys())

    # Call order: segment, micro-batch, loop, layer, (attention, moe).
    per = {}  # (branch, layer, loop) -> [x of micro-batch 0, x of micro-batch 1]
    it = iter(seen)
    for a, b in tr.segments:
        for _ in range(2):
            for t in range(a, b + 1):
                for l in range(L):
                    for _ in range(2):
                        branch, x = next(it)
                        per.setdefault((branch, l, t), []).append(x)
    assert next(it, None) is None
    for (branch, l, t), xs in per.items():
        where = f"layer_{l}/loop_{t}"
        flat = [x.reshape(-1, x.shape[-1])[v] for x, v in zip(xs, valid)]  # the real tokens
        norm = sum(f.norm(dim=-1).mean().item() for f in flat) / len(flat)
        var = sum(f.var(correction=0).item() for f in flat) / len(flat)
        assert out.diag[f"diag/{branch}/norm/{where}"] == pytest.approx(norm, rel=1e-6)
        assert out.diag[f"diag/{branch}/var/{where}"] == pytest.approx(var, rel=1e-6)
        rows = sample_rows(valid[0], step=1)
        assert len(set(rows.tolist())) == RANK_SAMPLE_ROWS and bool(valid[0][rows].all())
        erank, top, cos = direct_rank_collapse(xs[0].reshape(-1, xs[0].shape[-1])[rows])
        # The implementation takes σ = sqrt(eigenvalues) of the fp64 Gram matrix: a zero σ (the
        # debug model's D < 64 rows) comes out as ~sqrt(1e-16)·σ_1, so the trio agrees to ~1e-7.
        assert out.diag[f"diag/{branch}/erank/{where}"] == pytest.approx(erank, rel=1e-6)
        assert out.diag[f"diag/{branch}/top_sv/{where}"] == pytest.approx(top, rel=1e-6)
        assert out.diag[f"diag/{branch}/cos/{where}"] == pytest.approx(cos, rel=1e-6, abs=1e-9)
        assert 1.0 <= erank <= RANK_SAMPLE_ROWS

    # Gradient norms: the last segment's gradients are still there (max_norm 0: nothing clipped).
    grads = {n: p.grad for n, p in tr.model.named_parameters() if p.grad is not None}
    last = len(tr.segments)
    total_sq = 0.0
    for group, names in tr.model.param_groups().items():
        sq = sum(grads[n].double().pow(2).sum().item() for n in names if n in grads)
        total_sq += sq
        assert out.diag[f"diag/grad_norm/{group}/segment_{last}"] == pytest.approx(
            math.sqrt(sq), rel=1e-6
        )
        assert out.diag[f"diag/grad_norm/{group}/segment_1"] > 0 or not names
    assert math.sqrt(total_sq) == pytest.approx(
        out.grad_norm, rel=1e-6
    )  # the groups cover every parameter


def test_rank_collapse_extremes():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1, 16, generator=g, dtype=torch.float64)
    collapsed = (
        torch.rand(8, 1, generator=g, dtype=torch.float64) + 0.5
    ) * v  # rank one: every row along v
    erank, top, cos = rank_collapse(
        (collapsed @ collapsed.T).numpy()
    )  # fp64, as the trainer's Gram
    assert erank == pytest.approx(1.0, abs=1e-3) and top == pytest.approx(1.0, abs=1e-3)
    assert cos == pytest.approx(1.0, abs=1e-6)
    eye = torch.eye(8)
    assert rank_collapse(eye.numpy()) == pytest.approx((8.0, 1 / 8, 0.0))


def test_off_steps_keys_and_skipped_segments(tiny_pack, tmp_path):
    tr = make_trainer(
        tiny_pack,
        tmp_path,
        "--metrics.diag_interval",
        "2",
        "--metrics.diag_grad",
        "false",
        "--spike_guard.enable",
        "true",
        "--spike_guard.warmup_steps",
        "0",
    )
    batches = iter(tr.dataloader)
    assert tr.train_step(next(batches)).diag is None  # step 1: not a diagnostic step
    keys = tr.parts.training.diagnostics.keys()
    assert len(keys) == tr.model.args.n_layers * tr.model.num_loops * 2 * 5 and not any(
        "grad_norm" in k for k in keys
    )
    for _ in range(300):  # segment 1's baseline goes to ~0: step 2's segment 1 is a spike
        tr.spike_guard.accept(0, 0.0)
    out = tr.train_step(next(batches))
    assert out.skip_reason is not None and list(out.diag) == keys
    ran = [k for k, v in out.diag.items() if v is not None]
    assert ran and all(
        "loop_1/" in k + "/" or "loop_2/" in k + "/" for k in ran
    )  # segment 2 (loop 3) never ran
    assert all(out.diag[k] is None for k in keys if k.endswith("loop_3"))


def test_activation_checkpointing_gives_the_same_diagnostics(tiny_pack, tmp_path):
    # Per-loop AC recomputes the loops (observe included) in backward: the recomputation must
    # neither add to the statistics nor change them.
    batch = None
    diags = []
    for _i, mode in enumerate(("none", "loop")):
        tr = make_trainer(tiny_pack, tmp_path / mode, "--activation_checkpoint.mode", mode)
        batch = batch if batch is not None else next(iter(tr.dataloader))
        diags.append(tr.train_step(batch).diag)
    assert diags[0].keys() == diags[1].keys()
    for k in diags[0]:
        assert diags[1][k] == pytest.approx(diags[0][k], rel=1e-6, abs=1e-12), k
