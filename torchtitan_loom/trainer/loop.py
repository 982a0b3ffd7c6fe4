"""The Trainer: it owns the parts build.py makes (``TrainerParts``, parts.py) and runs the loop.

Read top to bottom: ``Trainer.__init__`` builds everything in TorchTitan order (``build``: the
model, what training needs, the services around it, the step); ``train_step`` is LOOM's segmented
step (LOOM_SPEC §6 with the §14 decisions), the step object of step.py. ``run`` here resumes and
runs the loop; how it ended is one typed Outcome (components/runtime/outcome.py) from which
``_finish`` alone writes the last line and run.json's status. Around it: the held-out eval is
components/evaluation/held_out.py, the step's metrics components/observability/step_metrics.py,
stop signals components/runtime/preemption.py, the launch and the exceptions' outcomes launch.py
(``python -m torchtitan_loom.train`` hands argv and this class to ``launch.run``). The model is
reached only through ``protocols.ModelProtocol``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from torchtitan_loom import launch
from torchtitan_loom.components.checkpoint import CheckpointManager, names
from torchtitan_loom.components.checkpoint.integrity import model_finite
from torchtitan_loom.components.data import TrainLoader
from torchtitan_loom.components.observability.metrics import peak_flops
from torchtitan_loom.components.observability.profiling import MemorySnapshotter, maybe_profile
from torchtitan_loom.components.observability.progress import final_line
from torchtitan_loom.components.observability.step_metrics import StepMetrics
from torchtitan_loom.components.optim.divergence import write_abort
from torchtitan_loom.components.optim.lr_scheduler import extension_note
from torchtitan_loom.components.optim.optimizer import apply_config_hyperparameters
from torchtitan_loom.components.optim.spike_guard import SpikeGuard
from torchtitan_loom.components.runtime import exit_codes, safe_files
from torchtitan_loom.components.runtime.gc_control import GarbageCollection
from torchtitan_loom.components.runtime.outcome import Outcome, Status
from torchtitan_loom.components.runtime.preemption import PreemptionWatcher
from torchtitan_loom.components.runtime.run_folder import new_run_id, record_launch
from torchtitan_loom.components.runtime.train_state import StepAbandoned, StepResult, TrainState
from torchtitan_loom.config import JobConfig, to_toml
from torchtitan_loom.config.validate import Resolved
from torchtitan_loom.distributed import utils as dist_utils
from torchtitan_loom.protocols import ModelProtocol
from torchtitan_loom.trainer.build import build
from torchtitan_loom.trainer.parts import TrainerParts


class Trainer:
    """One launch's training: ``parts`` (everything built, typed groups: parts.py) and the run's
    own state (whether it resumed, from which step, whether run.json records it); resume, the loop
    and the end are here. The parts read most often are read-only properties below."""

    def __init__(
        self,
        cfg: JobConfig,
        resolved: Resolved,
        info: dist_utils.DistInfo,
        run_id: str | None = None,
    ) -> None:
        self.parts: TrainerParts = build(cfg, resolved, info, run_id or new_run_id())
        self.in_step = True  # whether the loop is inside a step (else in the work after one)
        self.resumed = False  # resume() ran (train() calls it unless the caller did)
        self.resumed_from: int | None = None  # the step resume() loaded, None when it started fresh
        self.launch_recorded = False  # run.json says "running" for this launch (rank 0)

    # ------------------------------------------------------- the parts read most
    @property
    def cfg(self) -> JobConfig:
        return self.parts.setting.cfg

    @property
    def model_args(self) -> Any:
        return self.parts.setting.model_args

    @property
    def model(self) -> ModelProtocol:
        return self.parts.model_parts.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.parts.training.optimizer

    @property
    def state(self) -> TrainState:
        return self.parts.training.state

    @property
    def spike_guard(self) -> SpikeGuard:
        return self.parts.training.spike_guard

    @property
    def dataloader(self) -> TrainLoader:
        return self.parts.training.dataloader

    @property
    def segments(self) -> list[tuple[int, int]]:
        return self.parts.training.segments

    @property
    def checkpointer(self) -> CheckpointManager:
        return self.parts.services.checkpointer

    @property
    def stop_signals(self) -> PreemptionWatcher:
        return self.parts.services.stop_signals

    def log(self, msg: str) -> None:
        """A console line from the metrics rank only."""
        self.parts.setting.log(msg)

    def train_step(self, batch: dict[str, torch.Tensor]) -> StepResult:
        """One global step (LOOM_SPEC §6): the step object's call."""
        return self.parts.step(batch)

    # -------------------------------------------------------------------- loop
    def resume(self) -> None:
        """Load the checkpoint (if any), make the current config win over its optimizer values
        (LOOM_SPEC §7.7), and record the config that runs. Raises CheckpointError when it does not fit.
        ``train()`` calls it unless the caller already did (tests inspect a resumed trainer first)."""
        cfg, setting, training = self.cfg, self.parts.setting, self.parts.training
        self.resumed = True
        try:
            self.resumed_from = resumed = self.checkpointer.load()
        except BaseException:
            self.stop_signals.close()  # train() will not run: leave the signal handlers as found
            raise
        training.metrics.mark_launch(resumed)
        saved_total = self.checkpointer.loaded_total_steps
        if resumed is not None and saved_total is not None and saved_total != cfg.training.steps:
            self.log(extension_note(cfg.lr_scheduler, saved_total, cfg.training.steps, resumed + 1))
        if resumed is not None:
            for line in apply_config_hyperparameters(
                self.optimizer, training.lr_scheduler, cfg.optimizer
            ):
                self.log(f"resume: the config wins: {line}")
        was_world, world = self.checkpointer.loaded_world_size, setting.info.world_size
        launch.log_elastic_restart(self.log, resumed, was_world, world)
        if (
            setting.info.rank == 0
        ):  # after the resume succeeded: a refused one leaves the run as it was
            dump = cfg.job.dump_folder
            safe_files.atomic_write(os.path.join(dump, names.CONFIG_TOML), to_toml(cfg), dump)
            counts = self.model.param_counts()
            sizes = {
                "params": counts["total"],
                "active_params": counts["active"],
                "flops_per_token": training.flops_per_token,
            }
            args = setting.model_args
            record_launch(cfg, setting.run_id, "running", self.state.step, resumed, sizes, args)
            self.launch_recorded = True

    def train(self) -> int:
        """``run()``, for callers that want its exit code (0 also after a stop that saved)."""
        return self.run().exit_code

    def run(self) -> Outcome:
        """Resume, run the steps left and end the launch. Every way it ends is an Outcome that
        ``_finish`` acts on; an exception that is no known way to end (a bug) is recorded as
        failed and re-raised."""
        try:
            if not self.resumed:
                self.resume()
            outcome = self._loop()
            self.checkpointer.close()  # the save still in flight belongs to the run: committed
        except BaseException as exc:
            self.checkpointer.discard()  # nothing is committed after an error
            known = launch.outcome_of(exc, self.cfg, self.state.step, self.in_step)
            self._finish(known or Outcome(Status.FAILED, exit_codes.FAILED, "", error=True))
            if known is None:
                raise
            return known
        return self._finish(outcome)

    def _loop(self) -> Outcome:
        """The steps left, each followed by ``_after_step``; how they ended."""
        cfg, t, info, device = (
            self.cfg,
            self.cfg.training,
            self.parts.setting.info,
            self.parts.setting.device,
        )
        data_iter = iter(self.dataloader)
        report = StepMetrics(
            cfg.metrics,
            self.parts.training.metrics,
            tokens_per_step=t.global_batch_size * t.seq_len,
            flops_per_token=self.parts.training.flops_per_token,
            peak_flops=peak_flops(device),
            device=device,
            first_step=self.state.step,
            log=self.log,
            total_steps=t.steps,
            compiling=self.parts.model_parts.compiled_units,
        )
        tools = contextlib.ExitStack()  # profiler, memory snapshots and GC control
        profiler = tools.enter_context(
            maybe_profile(cfg.profiling, cfg.job.dump_folder, info.rank, self.log, self.state.step)
        )
        snapshots = MemorySnapshotter(
            cfg.profiling, cfg.job.dump_folder, info.rank, device, self.log
        )
        tools.callback(snapshots.close)
        gc_control = GarbageCollection(t.gc_freq)
        tools.callback(gc_control.close)  # automatic GC back on, also when the loop raises
        first_step = self.state.step + 1
        with tools:
            while self.state.step < t.steps:
                position = self.dataloader.state_dict()
                self.in_step = True  # an error from here is "during step N + 1" (launch.outcome_of)
                try:
                    out = self.train_step(next(data_iter))
                except StepAbandoned:  # a stop before the step's first update: nothing changed
                    self.optimizer.zero_grad(set_to_none=True)
                    self.dataloader.load_state_dict(position)  # trained after the resume
                    return self._abandoned()
                step = self.state.step
                self.in_step = False  # its metrics, eval and save: "after step N"
                if profiler is not None:
                    profiler.step()
                snapshots.step(step)
                gc_control.step(step)
                report.step_done(step)  # before its eval and save: the ETA's pace includes them
                if step == first_step and info.world_size > 1:
                    self._shorten_timeouts()  # init is over
                outcome = self._after_step(step, out, report)
                if outcome is not None:
                    return outcome
        return Outcome(Status.FINISHED, exit_codes.OK, "")

    def _after_step(self, step: int, out: StepResult, report: StepMetrics) -> Outcome | None:
        """Metrics, eval, divergence and checkpoint after global step ``step``; an Outcome to stop."""
        self._report(step, out, report)
        abort = self.parts.training.divergence.after_step(
            step, out.skip_reason, model_finite(self.model), out.non_finite
        )
        if abort:
            return self._diverged(abort)
        last = step == self.cfg.training.steps
        return self._save_or_stop(step, last=last, healthy=out.healthy, losses=out.seg_losses)

    def _report(self, step: int, out: StepResult, report: StepMetrics) -> None:
        """The step's record and console line, with the held-out eval and downstream scores due."""
        t = self.cfg.training
        scalars = (
            report.train_scalars(step, out, self.state.tokens_seen)
            if report.is_log_step(step, t.steps, out.skip_reason is not None)
            else {}
        )
        routing, held_out, downstream = (
            None,
            self.parts.services.held_out,
            self.parts.services.downstream,
        )
        if held_out.due(step, t.steps):
            with report.paused():  # tokens/s counts training time only
                eval_scalars, routing = held_out.validate(step)
            scalars.update(eval_scalars or {})
        console = bool(scalars)  # downstream scores have their own lines, diagnostics none
        if downstream is not None and downstream.due(step, t.steps):
            with report.paused():
                scalars.update(downstream.score(step) or {})
        scalars.update(out.diag or {})
        if scalars:
            report.write(step, scalars, out, routing, console=console)
        if out.skip_reason:
            self.log(f"step {step}: skipped {out.skip_reason}")

    def _diverged(self, abort: str) -> Outcome:
        """A divergence abort: the save in flight is discarded, nothing is saved or pruned, and the
        message names the newest checkpoint on disk (the one to resume from)."""
        dropped = self.checkpointer.discard(wait=True)
        if dropped is not None:
            abort += f"; the save of step {dropped} still in flight was discarded"
        newest = self.checkpointer.newest()
        if self.checkpointer.enabled:
            abort += f"; newest checkpoint: {newest or 'none'}"
        if self.parts.setting.info.rank == 0:
            write_abort(self.cfg.job.dump_folder, abort)
        return Outcome(Status.DIVERGED, exit_codes.BAD_INPUT, abort)

    def _abandoned(self) -> Outcome:
        """A stop agreed before the step's first update: save the step before it (if any)."""
        step = self.state.step
        if step:
            saved = self._save_or_stop(step, last=True, healthy=False)
            if saved is not None:  # the agreed stop, with this step saved
                return saved
        code = self.stop_signals.exit_code()
        return Outcome(Status.STOPPED, code, f"stopped before step {step + 1}")

    def _save_or_stop(
        self, step: int, *, last: bool, healthy: bool, losses: Sequence[float] = ()
    ) -> Outcome | None:
        """Save what the checkpoint policy asks for (``healthy``, ``losses``: whether this step
        proves the checkpoint before it); when the stop signals (or exit_after_step) stop the run
        here, this step is saved and the Outcome's line says so."""
        reason = self.stop_signals.stop_after(step, last=last)
        stopping = reason is not None
        where = self.checkpointer.after_step(
            step, last=last, stopping=stopping, healthy=healthy, losses=losses
        )
        if reason is None:
            return None
        code = self.stop_signals.exit_code()
        done = step >= self.cfg.training.steps and code == exit_codes.OK
        saved = f"saved {where}" if where else "nothing saved (checkpoints off)"
        return Outcome(
            Status.FINISHED if done else Status.STOPPED,
            code,
            f"{reason}, {saved}; {self.stop_signals.exit_note(saved=bool(where))}",
        )

    def _shorten_timeouts(self) -> None:
        cfg = self.cfg
        now_s = dist_utils.set_pg_timeouts(
            cfg.comm.train_timeout_seconds, dist_utils.mesh_groups(self.parts.setting.parallel_dims)
        )
        self.log(
            f"comm: collective timeout {cfg.comm.init_timeout_seconds} s during init, "
            f"{min(now_s):g} s from step 2 on ({len(now_s)} process groups)"
        )

    def _finish(self, outcome: Outcome) -> Outcome:
        """The one end of a launch: handlers back, files closed, the last line, and run.json's
        final status from ``outcome`` (rank 0, once this launch recorded itself as running)."""
        self.stop_signals.close()
        try:
            self.parts.training.metrics.close()
        except OSError as exc:  # e.g. the last flush of a full disk
            if not outcome.error:
                known = launch.outcome_of(exc, self.cfg, self.state.step)
                if known is None:  # not a way a launch ends that we know: a bug, with its traceback
                    raise
                outcome = known
        if outcome.error:
            for line in outcome.message.splitlines():
                print(line, file=sys.stderr)
        else:
            if outcome.message:
                self.log(outcome.message)
            dump, last_eval = self.cfg.job.dump_folder, self.parts.services.held_out.last
            self.log(final_line(self.state.step, outcome.exit_code, dump, last_eval))
        if self.launch_recorded:
            launch.record_end(
                self.cfg, self.parts.setting.run_id, outcome.status.value, self.state.step
            )
        return outcome
