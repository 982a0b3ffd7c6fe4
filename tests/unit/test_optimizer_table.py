"""The optimizer table (issue 36): each optimizer is one entry (its builder, its [optimizer] keys,
its state bytes per parameter); Lion beside AdamW. Lion's update is checked against the formula
written out here; a Lion run trains, saves and resumes bit-identically; the optimizer is part of
the run (run.json's identity, each checkpoint's meta.json), so a resume under another optimizer is
refused with one line instead of reading AdamW's moments as Lion's momentum."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from tests.unit.test_checkpoint import assert_same_state, make_trainer, run
from torchtitan_loom.components.checkpoint import CheckpointError, integrity
from torchtitan_loom.components.optim.choices import OPTIMIZERS
from torchtitan_loom.components.optim.lion import Lion
from torchtitan_loom.components.optim.optimizer import BUILDERS, build_optimizer
from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve


def test_every_optimizer_is_one_entry_of_the_table():
    assert set(BUILDERS) == set(OPTIMIZERS) == {"AdamW", "Lion"}
    section = load_config(["--optimizer.name", "Lion"]).optimizer
    model = torch.nn.Linear(3, 2)
    assert isinstance(build_optimizer(model, section), Lion)
    # The state each keeps per parameter is what the table says it is (fp32 parameters).
    for name, info in OPTIMIZERS.items():
        opt = build_optimizer(model, load_config(["--optimizer.name", name]).optimizer)
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        tensors = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        assert state_bytes == info.state_bytes_per_param * sum(
            p.numel() for p in model.parameters()
        )


def test_lion_steps_as_its_formula_says():
    torch.manual_seed(0)
    p0 = torch.randn(5, 4, dtype=torch.float64)
    grads = [torch.randn(5, 4, dtype=torch.float64) for _ in range(3)]
    lr, b1, b2, wd = 0.01, 0.9, 0.99, 0.1
    param = torch.nn.Parameter(p0.clone())
    frozen = torch.nn.Parameter(p0.clone())  # never gets a gradient: never touched
    opt = Lion([param, frozen], lr=lr, betas=(b1, b2), weight_decay=wd)
    p, m = p0.clone(), torch.zeros_like(p0)
    for g in grads:
        param.grad = g.clone()
        opt.step()
        c = b1 * m + (1 - b1) * g  # the reference, written out
        p = p * (1 - lr * wd) - lr * torch.sign(c)
        m = b2 * m + (1 - b2) * g
    # Float64: a sign is exact and the rest are a few roundings of O(1) numbers.
    torch.testing.assert_close(param.detach(), p, rtol=0, atol=1e-12)
    torch.testing.assert_close(opt.state[param]["momentum"], m, rtol=0, atol=1e-12)
    assert torch.equal(frozen.detach(), p0) and frozen not in opt.state


LION = ("--optimizer.name", "Lion", "--optimizer.lr", "3e-4", "--optimizer.beta2", "0.99")


def test_a_lion_run_trains_and_resumes_exactly(tiny_pack, tmp_path, capsys):
    common = ("--training.steps", "6", "--checkpoint.interval", "3", *LION)
    straight = run(make_trainer(tiny_pack, tmp_path, *common))
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert isinstance(straight.optimizer, Lion)
    meta = json.loads((tmp_path / "checkpoint" / "step-6" / "meta.json").read_text())
    assert meta["optimizer"] == "Lion"
    resumed = make_trainer(tiny_pack, tmp_path, *common, "--checkpoint.load_step", "3")
    assert resumed.state.step == 3
    run(resumed)
    assert_same_state(straight, resumed)


def test_a_resume_under_another_optimizer_is_refused(tiny_pack, tmp_path):
    run(make_trainer(tiny_pack, tmp_path, "--training.steps", "4", "--checkpoint.interval", "2"))
    relaunch = ("--training.steps", "6", *LION)
    # The run folder's identity names the optimizer: refused before anything is built.
    with pytest.raises(ConfigError, match=r"optimizer.name: 'AdamW' → 'Lion'"):
        resolve(load_config(_argv(tiny_pack, tmp_path, *relaunch)), 1)
    # Without run.json (a copied checkpoint folder), the checkpoint's own record refuses it.
    os.remove(tmp_path / "run.json")
    with pytest.raises(CheckpointError) as exc:
        make_trainer(tiny_pack, tmp_path, *relaunch)
    message = str(exc.value)
    assert "was trained with optimizer.name = 'AdamW'; 'Lion' cannot continue" in message
    assert len(message.splitlines()) == 1


def test_a_run_recorded_before_optimizers_had_names_resumes_as_adamw(tiny_pack, tmp_path):
    run(make_trainer(tiny_pack, tmp_path, "--training.steps", "4", "--checkpoint.interval", "2"))
    for path in (tmp_path / "run.json", tmp_path / "checkpoint" / "step-4" / "meta.json"):
        record = json.loads(path.read_text())
        record.get("identity", record).pop("optimizer.name", None)
        record.pop("optimizer", None)
        path.write_text(json.dumps(record))
    integrity.write_checksums(str(tmp_path / "checkpoint" / "step-4"))  # as an older save wrote it
    t = make_trainer(tiny_pack, tmp_path, "--training.steps", "6")
    assert t.state.step == 4 and type(t.optimizer).__name__ == "AdamW"


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
        "--training.mixed_precision_param",
        "float32",
        "--checkpoint.enable",
        *extra,
    ]


def test_the_estimate_and_the_start_line_read_the_table():
    from torchtitan_loom.components.observability.progress import estimate_step

    dims = SimpleNamespace(dp=1, dp_shard=1)
    counts = {"total": 1000, "active": 500}
    adamw = estimate_step(load_config([]), dims, counts, 0.0, None, 3)
    lion = estimate_step(load_config(["--optimizer.name", "Lion"]), dims, counts, 0.0, None, 3)
    gib = float(1 << 30)
    assert adamw.state_gib * gib == pytest.approx(16 * 1000)  # weight + gradient + 2 moments
    assert lion.state_gib * gib == pytest.approx(12 * 1000)  # weight + gradient + 1 momentum
