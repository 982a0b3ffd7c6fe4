"""The segmented step is an object built from named parts (trainer/step.py StepParts), callable
without a Trainer: built here from a model, optimizer, schedule, guard, state and segments made
by hand, one step of it equals the Trainer's step on the same batch, bit for bit (one process on
one CPU runs the same kernels in the same order; nothing may differ)."""

import contextlib

import torch
from test_train_step import batch_of, make_trainer

from torchtitan_loom.components.observability.diagnostics import build_diagnostics
from torchtitan_loom.components.optim.lr_scheduler import build_lr_scheduler
from torchtitan_loom.components.optim.optimizer import build_optimizer
from torchtitan_loom.components.optim.spike_guard import SpikeGuard
from torchtitan_loom.components.runtime.preemption import PreemptionWatcher
from torchtitan_loom.components.runtime.train_state import TrainState
from torchtitan_loom.models.loom import LoomTransformer
from torchtitan_loom.protocols import segments
from torchtitan_loom.trainer.step import SegmentedStep, StepParts


def _split(mb_rows):
    def micro_batches(batch):
        rows = batch["input_ids"].shape[0]
        return [{k: v[i : i + mb_rows] for k, v in batch.items()} for i in range(0, rows, mb_rows)]

    return micro_batches


def _step_alone(cfg, model_args):
    """A step over parts made here: the package's builders for optimizer and schedule (the same
    hyper-parameters as the Trainer's), nothing of the Trainer."""
    model = LoomTransformer(model_args)
    model.init_weights()
    optimizer = build_optimizer(model, cfg.optimizer)
    s = cfg.lr_scheduler
    schedule = build_lr_scheduler(
        optimizer,
        total_steps=cfg.training.steps,
        warmup_ratio=s.warmup_ratio,
        decay_ratio=s.decay_ratio,
        min_ratio=s.min_ratio,
        kind=s.kind,
    )
    loops = segments(model.num_loops, cfg.training.bp_segment_len)
    stop = PreemptionWatcher(False, "cpu")
    parts = StepParts(
        model=model,
        params=[p for p in model.parameters() if p.requires_grad],
        optimizer=optimizer,
        lr_scheduler=schedule,
        finish_gradients=lambda: None,  # one process: nothing to reduce
        before_micro_batch=lambda last: None,
        spike_guard=SpikeGuard(cfg.spike_guard),
        state=TrainState(),
        segments=loops,
        stop_signals=stop,
        diagnostics=build_diagnostics(cfg.metrics, model, len(loops), torch.device("cpu")),
        micro_batches=_split(cfg.training.micro_batch_size),
        autocast=contextlib.nullcontext,
        max_norm=cfg.training.max_norm,
        dp_degree=1,
        device=torch.device("cpu"),
    )
    return SegmentedStep(parts), stop


def test_a_step_built_from_its_parts_equals_the_trainers(tiny_pack, tmp_path):
    trainer = make_trainer(
        tiny_pack,
        tmp_path,
        "--model.num_loops",
        "6",
        "--training.bp_segment_len",
        "3",
        "--training.micro_batch_size",
        "2",
        "--training.max_norm",
        "1.0",
        "--spike_guard.enable",
        "true",
    )
    step, stop = _step_alone(trainer.cfg, trainer.model_args)
    model = step.parts.model
    want_sd = trainer.model.state_dict()
    for name, value in model.state_dict().items():  # the same layout-independent init
        assert torch.equal(value, want_sd[name]), name
    try:
        batches = iter(trainer.dataloader)
        for _ in range(2):  # the second step starts from the first one's optimizer state
            batch = next(batches)
            want = trainer.train_step(batch)
            got = step(batch)
            assert got.seg_losses == want.seg_losses and len(got.seg_losses) == 2
            assert got.grad_norm == want.grad_norm and got.healthy == want.healthy
            assert torch.equal(got.counts_LHE, want.counts_LHE)
        assert step.parts.state.step == trainer.state.step == 2
        want_sd = trainer.model.state_dict()
        for name, value in model.state_dict().items():
            assert torch.equal(value, want_sd[name]), name
    finally:
        stop.close()
        trainer.stop_signals.close()


def test_the_step_reads_the_part_it_holds(tiny_pack, tmp_path):
    """A part swapped on the step is the one used: here a guard that refuses every segment, so
    the step skips and the model is untouched (the decision order's skip branch, without a
    Trainer)."""
    trainer = make_trainer(tiny_pack, tmp_path)
    step, stop = _step_alone(trainer.cfg, trainer.model_args)

    class RefuseAll:
        def check(self, j, loss, step):
            return "refused by the test"

    step.parts.spike_guard = RefuseAll()
    before = {k: v.clone() for k, v in step.parts.model.state_dict().items()}
    try:
        out = step(batch_of(trainer))
    finally:
        stop.close()
        trainer.stop_signals.close()
    assert out.skip_reason == "segment 1 (loops 1-3): refused by the test"
    assert step.parts.state.skipped_segments == 1 and step.parts.state.step == 1
    for name, value in step.parts.model.state_dict().items():
        assert torch.equal(value, before[name]), name
