"""The Trainer is composed (issue 44 item 2): ``build`` returns typed, frozen parts made by
functions that take what they read, without a Trainer; the Trainer owns one ``TrainerParts``,
derives from no class of the project's, and its properties read the parts it owns."""

import dataclasses

import pytest
import torch
from test_train_step import CPU

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.trainer import Trainer, TrainerParts
from torchtitan_loom.trainer.build import build
from torchtitan_loom.trainer.parts import ModelParts, Services, Setting, TrainingParts


def _cfg(pack, dump):
    return load_config(
        [
            *("--data.path", str(pack), "--job.dump_folder", str(dump)),
            *("--training.seq_len", "32", "--training.mixed_precision_param", "float32"),
            *("--metrics.enable_tensorboard", "false", "--eval.interval", "0"),
        ]
    )


def test_the_trainer_derives_from_no_class_of_the_project():
    bases = [c for c in Trainer.__mro__[1:] if c.__module__.startswith("torchtitan_loom")]
    assert bases == [], bases


def test_the_parts_are_built_without_a_trainer_and_equal_its(tiny_pack, tmp_path):
    cfg = _cfg(tiny_pack, tmp_path / "alone")
    parts = build(cfg, resolve(cfg, 1), CPU, "alone")
    trainer_cfg = _cfg(tiny_pack, tmp_path / "trainer")
    trainer = Trainer(trainer_cfg, resolve(trainer_cfg, 1), CPU)
    try:
        assert isinstance(parts, TrainerParts) and isinstance(parts.setting, Setting)
        assert isinstance(parts.model_parts, ModelParts)
        assert isinstance(parts.training, TrainingParts) and isinstance(parts.services, Services)
        # The step holds the very objects the other builders returned (one of each, shared).
        held, t = parts.step.parts, parts.training
        assert held.model is parts.model_parts.model and held.params is parts.model_parts.params
        assert held.optimizer is t.optimizer and held.lr_scheduler is t.lr_scheduler
        assert held.state is t.state and held.spike_guard is t.spike_guard
        assert held.stop_signals is parts.services.stop_signals
        # Built alone or by a Trainer: the same model, and the same first step on the same batch.
        want_sd = trainer.model.state_dict()
        for name, value in parts.model_parts.model.state_dict().items():
            assert torch.equal(value, want_sd[name]), name
        batch = next(iter(trainer.dataloader))
        got, want = parts.step(batch), trainer.train_step(batch)
        assert got.seg_losses == want.seg_losses and got.grad_norm == want.grad_norm
        assert parts.training.state.step == trainer.state.step == 1
    finally:
        parts.services.stop_signals.close()
        trainer.stop_signals.close()


def test_the_parts_are_set_once_and_the_trainer_reads_them(tiny_pack, tmp_path):
    cfg = _cfg(tiny_pack, tmp_path / "run")
    trainer = Trainer(cfg, resolve(cfg, 1), CPU)
    trainer.stop_signals.close()
    parts = trainer.parts
    for group, field in [
        (parts, "step"),
        (parts.setting, "cfg"),
        (parts.model_parts, "model"),
        (parts.training, "optimizer"),
        (parts.services, "checkpointer"),
    ]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(group, field, None)
    assert trainer.model is parts.model_parts.model and trainer.state is parts.training.state
    assert trainer.checkpointer is parts.services.checkpointer and trainer.cfg is cfg
    with pytest.raises(AttributeError):
        trainer.model = None  # type: ignore[misc]  # a read-only view of the part
