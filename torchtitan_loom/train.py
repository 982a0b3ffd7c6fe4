"""The trainer: config → model on meta → parallelize → init → optimizer, data, metrics → loop.

Read top to bottom: ``Trainer.__init__`` builds everything in TorchTitan order (the model, what
training needs, the services around it); ``train_step`` is LOOM's segmented step (LOOM_SPEC §6 with
the §14 decisions) in three pieces per backprop segment: ``_backward_segment`` (forward/backward of
every micro-batch), ``_finish_segment`` (the gradients reduced, the segment's one all-reduce of
statistics with every rank's stop flag) and ``_update`` (the decision order non-finite → spike →
clip → step, in one place). ``train`` resumes and runs the loop; how it ended is one typed Outcome
(components/runtime/outcome.py) from which ``_finish`` alone writes the last line and run.json's
status. Around it: the held-out eval is components/evaluation/held_out.py, the step's metrics
components/observability/step_metrics.py, stop signals components/runtime/preemption.py, the
launch and the exceptions' outcomes launch.py (``main`` here). The model is reached only through
``protocols.ModelProtocol``.

Legend (the package's, see protocols.py): B rows, S sequence length, L layers, H loops, T loops of a
segment, E routed experts.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not {"--help", "-h"} & set(sys.argv):
    # `python -m`: importing torch and the trainer takes seconds on a cold start; say so first.
    print("[torchtitan_loom] importing torch and the trainer ...", flush=True)

import contextlib
import math
import os
from typing import Any

import torch

from torchtitan_loom import launch
from torchtitan_loom.components.checkpoint import CheckpointManager
from torchtitan_loom.components.checkpoint.integrity import model_finite
from torchtitan_loom.components.data import build_train_loader, bundled_corpus_path
from torchtitan_loom.components.evaluation.downstream import build_scorer
from torchtitan_loom.components.evaluation.held_out import HeldOutEval
from torchtitan_loom.components.loss import count_valid, token_ce_sum
from torchtitan_loom.components.observability.diagnostics import build_diagnostics
from torchtitan_loom.components.observability.metrics import MetricsLogger, peak_flops
from torchtitan_loom.components.observability.profiling import MemorySnapshotter, maybe_profile
from torchtitan_loom.components.observability.progress import final_line, start_report
from torchtitan_loom.components.observability.step_metrics import StepMetrics
from torchtitan_loom.components.optim.divergence import (
    DivergenceMonitor,
    non_finite_statistic,
    write_abort,
)
from torchtitan_loom.components.optim.lr_scheduler import build_lr_scheduler, extension_note
from torchtitan_loom.components.optim.optimizer import apply_config_hyperparameters, build_optimizer
from torchtitan_loom.components.optim.spike_guard import SpikeGuard
from torchtitan_loom.components.quantization.float8 import build_float8_converter
from torchtitan_loom.components.runtime import exit_codes, safe_files
from torchtitan_loom.components.runtime.gc_control import GarbageCollection
from torchtitan_loom.components.runtime.outcome import Outcome, Status
from torchtitan_loom.components.runtime.preemption import PreemptionWatcher
from torchtitan_loom.components.runtime.run_folder import new_run_id, record_launch
from torchtitan_loom.components.runtime.train_state import StepAbandoned, StepResult, TrainState
from torchtitan_loom.config import JobConfig, to_toml
from torchtitan_loom.config.validate import Resolved
from torchtitan_loom.data_contract import real_tokens
from torchtitan_loom.distributed import utils as dist_utils
from torchtitan_loom.protocols import ModelProtocol, UpdatesAfterStep, get_train_spec, segments


class Trainer:
    def __init__(
        self,
        cfg: JobConfig,
        resolved: Resolved,
        info: dist_utils.DistInfo,
        run_id: str | None = None,
    ) -> None:
        self.cfg, self.info, self.device = cfg, info, info.device
        self.run_id = run_id or new_run_id()
        self.model_args, self.parallel_dims = resolved
        t = cfg.training
        dist_utils.set_determinism(t.seed, t.deterministic)
        self.compute_dtype = dist_utils.DTYPES[t.mixed_precision_param]
        self.reduce_dtype = dist_utils.DTYPES[t.mixed_precision_reduce]
        # Meshes first: resolve() checked every degree (ParallelDims) before any process group existed.
        self.parallel_dims.build_meshes(self.device.type)
        # FSDP's MixedPrecisionPolicy casts the parameters; autocast would only add casts on top.
        self.use_autocast = (
            self.compute_dtype != torch.float32 and not self.parallel_dims.fsdp_enabled
        )
        self.spec = get_train_spec(cfg.model.name)
        self.model: ModelProtocol = self._build_model()
        self._build_training()
        # Built last, once everything they watch or save exists; train() loads (TorchTitan's order).
        self._build_services()

    # ------------------------------------------------------------------ building
    def _build_model(self) -> ModelProtocol:
        """meta → (converters) → parallelize → materialise → layout-independent init."""
        cfg, t = self.cfg, self.cfg.training
        with torch.device("meta"):
            model = self.spec.model_cls(self.model_args)
        if self.info.rank == cfg.metrics.log_rank:  # within seconds of start, before any allocation
            n_segments = len(segments(model.num_loops, t.bp_segment_len))
            for line in start_report(
                cfg,
                self.parallel_dims,
                model,
                n_segments,
                self.device,
                self.compute_dtype,
                cost_fn=self.spec.cost_fn,
            ):
                self.log(line)
        # None unless float8.enable
        self.float8 = build_float8_converter(
            cfg.float8, t.device, self.spec, t.micro_batch_size * t.seq_len
        )
        if self.float8 is not None:
            self.log(self.float8.convert(model).summary(self.float8.plan))
        if self.spec.parallelize_fn is not None:
            model, self.finish_gradients, self.before_micro_batch = self.spec.parallelize_fn(
                model, self.parallel_dims, cfg
            )
        else:  # a plain replicated model: every gradient is summed over the ranks
            self.finish_gradients = lambda: dist_utils.reduce_gradients(
                self.params, self.reduce_dtype
            )
            self.before_micro_batch = lambda last: None
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights()
        # Tensorwise float8 scale precompute: only when FSDP sharded the float8 weights.
        self.float8_precompute = self.float8 is not None and self.float8.precompute_applies(model)
        if self.float8_precompute:
            self.log(
                "float8: FSDP shards the float8 weights; their scales are precomputed after each "
                "optimizer step"
            )
        if self.spec.kernel_report_fn is not None:  # which kernels the model picked, said once
            for line in self.spec.kernel_report_fn(
                model, self.device.type, self.compute_dtype, cfg.compile.enable
            ):
                self.log(line)
        self.params = [p for p in model.parameters() if p.requires_grad]
        return model.train()

    def _build_training(self) -> None:
        """Segments, optimizer, schedule, spike guard, train state, divergence, data, metrics."""
        cfg, t, s, model = self.cfg, self.cfg.training, self.cfg.lr_scheduler, self.model
        self.num_loops = model.num_loops
        self.segments = segments(self.num_loops, t.bp_segment_len)
        self.diagnostics = build_diagnostics(cfg.metrics, model, len(self.segments), self.device)
        self.optimizer = build_optimizer(model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer,
            total_steps=t.steps,
            warmup_ratio=s.warmup_ratio,
            decay_ratio=s.decay_ratio,
            min_ratio=s.min_ratio,
            kind=s.kind,
        )
        self.spike_guard = SpikeGuard(cfg.spike_guard)
        self.state = TrainState()
        g = cfg.spike_guard
        self.divergence = DivergenceMonitor(g.abort_on_spike, g.max_consecutive_skips, self.state)
        self.data_path = cfg.data.path or bundled_corpus_path(
            cfg.data.cache_dir or None, log=self.log
        )
        self.vocab_size = model.args.vocab_size
        self.tokenizer_name = cfg.data.tokenizer or None  # checked against the pack's own record
        self.dataloader = build_train_loader(
            self.data_path,
            seq_len=t.seq_len,
            vocab_size=self.vocab_size,
            global_batch_rows=t.global_batch_size,
            dp_rank=self.info.rank,
            dp_world=self.parallel_dims.dp,
            tokenizer_name=self.tokenizer_name,
        )
        self.metrics = MetricsLogger(
            cfg.job.dump_folder,
            cfg.metrics,
            rank=self.info.rank,
            run_id=self.run_id,
            wandb_config=cfg.to_dict(),
        )
        # The head runs once per segment, so it counts once per segment (see the model docstring).
        self.flops_per_token = model.flops_per_token(t.seq_len, head_calls=len(self.segments))
        self._log_layout()

    def _log_layout(self) -> None:
        cfg, t, info, counts = self.cfg, self.cfg.training, self.info, self.model.param_counts()
        self.log(
            f"model {cfg.model.name}/{cfg.model.flavor}: {counts['total']:,} parameters "
            f"({counts['active']:,} active per token), H={self.num_loops}, segments={self.segments}, "
            f"world={info.world_size}, device={self.device}, compute dtype={t.mixed_precision_param}, "
            f"init seed={self.model.args.init_seed} (training.seed), data={self.data_path}"
        )
        if info.world_size > 1:
            self.log(
                "parallelism: "
                + "; ".join(line.strip() for line in self.parallel_dims.describe().splitlines())
                + f"; activation_checkpoint={cfg.activation_checkpoint.mode}, "
                f"compile={cfg.compile.enable}"
            )

    def _build_services(self) -> None:
        """Stop signals, the held-out and downstream evals, the checkpoint manager."""
        cfg, ck, t, info = self.cfg, self.cfg.checkpoint, self.cfg.training, self.info
        self.stop_signals = PreemptionWatcher(
            ck.enable and ck.save_on_signal,
            self.device,
            exit_after_step=ck.exit_after_step if ck.enable else 0,
        )
        common = dict(
            model=self.model,
            data_path=self.data_path,
            tokenizer_name=self.tokenizer_name,
            vocab_size=self.vocab_size,
            device=self.device,
            autocast=self.autocast,
            stop_requested=self.stop_signals.requested,
            log=self.log,
        )
        self.held_out = HeldOutEval(
            cfg.eval,
            val_path=cfg.data.val_path or None,
            seq_len=t.seq_len,
            batch_rows=t.global_batch_size,
            dp_rank=info.rank,
            dp_world=self.parallel_dims.dp,
            micro_batches=self.micro_batches,
            **common,
        )
        self.downstream = build_scorer(cfg.eval, **common)
        self.resumed, self.resumed_from = False, None
        self.launch_recorded = False  # run.json says "running" for this launch (rank 0)
        states = {"lr_scheduler": self.lr_scheduler, "dataloader": self.dataloader}
        states.update(spike_guard=self.spike_guard, train_state=self.state)
        self.checkpointer = CheckpointManager(
            ck,
            dump_folder=cfg.job.dump_folder,
            model=self.model,
            optimizer=self.optimizer,
            states=states,
            model_args=self.model_args,
            model_name=cfg.model.name,
            flavor=cfg.model.flavor,
            config_toml=to_toml(cfg),
            total_steps=t.steps,
            device=self.device,
            rank=info.rank,
            world_size=info.world_size,
            log=self.log,
        )

    # ------------------------------------------------------------------ helpers
    def log(self, msg: str) -> None:
        if self.info.rank == self.cfg.metrics.log_rank:
            print(f"[torchtitan_loom] {msg}", flush=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast without FSDP (a single process included); under FSDP its MixedPrecisionPolicy
        computes with bf16 parameters instead; fp32 runs are plain."""
        if not self.use_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        mb = self.cfg.training.micro_batch_size
        rows = batch["input_ids"].shape[0]
        return [
            {k: v[i : i + mb].to(self.device, non_blocking=True) for k, v in batch.items()}
            for i in range(0, rows, mb)
        ]

    # ---------------------------------------------------------------- the step
    def train_step(self, batch: dict[str, torch.Tensor]) -> StepResult:
        """One global step: ⌈H/K⌉ segments, each _backward_segment → _finish_segment → _update,
        then the expert-bias update and the schedule."""
        micro = self.micro_batches(batch)
        # The divisor of every micro-batch loss: valid targets of the whole GLOBAL batch, so the
        # summed gradient is the token mean whatever the world size and micro-batching (§14).
        # Kept on the device (read with segment 1's statistics, no sync of its own); an integer
        # < 2^24 is exact in fp32, so ce_sum / denom_t equals the division by the Python count.
        n_valid_t = dist_utils.all_reduce(
            sum(count_valid(m["labels"]) for m in micro).to(torch.float64).reshape(1)
        )
        n_layers, n_experts = self.model.routing or (0, 0)
        out = StepResult(
            counts_LHE=torch.zeros(
                n_layers, self.num_loops, n_experts, dtype=torch.int64, device=self.device
            ),
            lr=self.optimizer.param_groups[0]["lr"],
        )
        carries: list[Any] = [None] * len(micro)
        diag = self.diagnostics.begin(self.state.step + 1)  # None on most steps: nothing extra
        for j in range(len(self.segments)):
            ce_total = self._backward_segment(j, micro, carries, n_valid_t, out.counts_LHE, diag)
            stats = self._finish_segment(j, ce_total, n_valid_t, diag)
            out.n_valid = stats.n_valid
            if not self._update(j, stats, out):
                break
        # The model's after-step update (LOOM: expert bias, §5.2) once per global step, from the
        # counts summed over loops, micro-batches and ranks; none when a segment was skipped. A
        # model without routed experts has no counts to sum (no collective).
        if self.model.routing is not None:
            out.counts_LHE = dist_utils.all_reduce(out.counts_LHE)
        if out.skip_reason is None and isinstance(self.model, UpdatesAfterStep):
            self.model.after_step(out.counts_LHE.sum(1))
        self.lr_scheduler.step()
        self.state.step += 1
        self.state.tokens_seen += int(out.n_valid)
        out.diag = None if diag is None else diag.finish()
        return out

    def _backward_segment(
        self,
        j: int,
        micro: list[dict[str, torch.Tensor]],
        carries: list[Any],
        n_valid_t: torch.Tensor,
        counts_LHE: torch.Tensor,
        diag: Any,
    ) -> torch.Tensor:
        """Piece 1: zero_grad, then forward/backward of every micro-batch over segment j's loops,
        each starting from its carry; returns the segment's summed token CE (fp64, on the device)."""
        a, b = self.segments[j]
        self.optimizer.zero_grad(set_to_none=True)
        denom_t = n_valid_t.clamp_min(1.0)
        aux_divisor = len(micro) * self.parallel_dims.dp
        ce_total = torch.zeros((), dtype=torch.float64, device=self.device)
        for m, mb in enumerate(micro):
            self.before_micro_batch(m == len(micro) - 1)  # FSDP reduces after the last one
            with self.autocast():
                observe = None if diag is None else diag.observer(m, real_tokens(mb["doc_ids"]))
                out = self.model(
                    mb["input_ids"],
                    mb["positions"],
                    mb["doc_ids"],
                    loop_start=a,
                    loop_end=b,
                    carry=carries[m],
                    observe=observe,
                )
            ce_sum = token_ce_sum(out.logits_BSV, mb["labels"])
            loss = ce_sum / denom_t.to(ce_sum.dtype).reshape(()) + out.aux_loss / aux_divisor
            loss.backward()
            carries[m] = out.carry.detach()  # truncated BPTT: the next segment starts from values
            ce_total += ce_sum.detach().double()
            if out.counts_LTE is not None:
                counts_LHE[:, a - 1 : b] += out.counts_LTE
            if diag is not None:
                diag.add_forward(a, out.observed_LTNK)
        return ce_total

    def _finish_segment(
        self, j: int, ce_total: torch.Tensor, n_valid_t: torch.Tensor, diag: Any
    ) -> dist_utils.StepStatistics:
        """Piece 2: sum what the parallel wrappers did not reduce (the parallelize seam knows
        which), then the segment's one all-reduce and host sync (loss, gradient norm², non-finite
        count, every rank's stop flag), which the decision and the clip both read. A stop agreed
        at segment 1 abandons the step: no update has happened yet."""
        self.finish_gradients()
        if diag is not None:
            diag.add_gradients(j, self.params)
        stats = dist_utils.step_statistics(
            self.params, ce_total, self.stop_signals.flag_tensor(), n_valid_t
        )
        if self.stop_signals.observe(stats.stop_flag) and j == 0:
            raise StepAbandoned
        return stats

    def _update(self, j: int, stats: dist_utils.StepStatistics, out: StepResult) -> bool:
        """Piece 3, the decision order in one place: non-finite → spike → clip → step. Records the
        segment in ``out``; False when it is skipped (the rest of the step with it)."""
        a, b = self.segments[j]
        seg_loss = stats.loss_sum / max(stats.n_valid, 1.0)
        out.seg_losses.append(seg_loss)
        # Never stepped on, whatever the guard says; the run then stops (components/optim/divergence.py).
        bad = non_finite_statistic(seg_loss, stats.non_finite)
        if bad:
            out.non_finite = f"{bad} in segment {j + 1} (loops {a}-{b})"
        # Only finite spikes are skipped and trained past.
        skip = bad or self.spike_guard.check(j, seg_loss, self.state.step + 1)
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
            self.state.skipped_segments += 1
            out.skip_reason, out.healthy = f"segment {j + 1} (loops {a}-{b}): {skip}", False
            return False
        out.healthy = out.healthy and self.spike_guard.breach(j, seg_loss) is None  # warm-up too
        dist_utils.clip_grads_with_total_norm(
            self.params, stats.grad_norm_sq_t, self.cfg.training.max_norm
        )
        norm_sq = stats.grad_norm_sq  # pre-clip; finite pieces can still overflow their sum
        out.grad_norm = math.sqrt(norm_sq) if math.isfinite(norm_sq) else float("nan")
        self.optimizer.step()
        if self.float8_precompute:
            self.float8.post_optimizer_hook(self.model)
        self.spike_guard.accept(j, seg_loss)
        return True

    # -------------------------------------------------------------------- loop
    def resume(self) -> None:
        """Load the checkpoint (if any), make the current config win over its optimizer values
        (LOOM_SPEC §7.7), and record the config that runs. Raises CheckpointError when it does not fit.
        ``train()`` calls it unless the caller already did (tests inspect a resumed trainer first)."""
        cfg = self.cfg
        self.resumed = True
        try:
            self.resumed_from = resumed = self.checkpointer.load()
        except BaseException:
            self.stop_signals.close()  # train() will not run: leave the signal handlers as found
            raise
        self.metrics.mark_launch(resumed)
        saved_total = self.checkpointer.loaded_total_steps
        if resumed is not None and saved_total is not None and saved_total != cfg.training.steps:
            self.log(extension_note(cfg.lr_scheduler, saved_total, cfg.training.steps, resumed + 1))
        if resumed is not None:
            for line in apply_config_hyperparameters(
                self.optimizer, self.lr_scheduler, cfg.optimizer
            ):
                self.log(f"resume: the config wins: {line}")
        was_world, world = self.checkpointer.loaded_world_size, self.info.world_size
        launch.log_elastic_restart(self.log, resumed, was_world, world)
        if (
            self.info.rank == 0
        ):  # after the resume succeeded: a refused one leaves the run as it was
            safe_files.atomic_write(os.path.join(cfg.job.dump_folder, "config.toml"), to_toml(cfg))
            record_launch(cfg, self.run_id, "running", self.state.step, resumed)
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
            known = launch.outcome_of(exc, self.cfg, self.state.step)
            self._finish(known or Outcome(Status.FAILED, exit_codes.FAILED, "", error=True))
            if known is None:
                raise
            return known
        return self._finish(outcome)

    def _loop(self) -> Outcome:
        """The steps left, each followed by ``_after_step``; how they ended."""
        cfg, t = self.cfg, self.cfg.training
        data_iter = iter(self.dataloader)
        report = StepMetrics(
            cfg.metrics,
            self.metrics,
            tokens_per_step=t.global_batch_size * t.seq_len,
            flops_per_token=self.flops_per_token,
            peak_flops=peak_flops(self.device),
            device=self.device,
            first_step=self.state.step,
            log=self.log,
            total_steps=t.steps,
            compiling=cfg.compile.enable,
        )
        tools = contextlib.ExitStack()  # profiler, memory snapshots and GC control
        profiler = tools.enter_context(
            maybe_profile(
                cfg.profiling, cfg.job.dump_folder, self.info.rank, self.log, self.state.step
            )
        )
        snapshots = MemorySnapshotter(
            cfg.profiling, cfg.job.dump_folder, self.info.rank, self.device, self.log
        )
        tools.callback(snapshots.close)
        gc_control = GarbageCollection(t.gc_freq)
        tools.callback(gc_control.close)  # automatic GC back on, also when the loop raises
        first_step = self.state.step + 1
        with tools:
            while self.state.step < t.steps:
                position = self.dataloader.state_dict()
                try:
                    out = self.train_step(next(data_iter))
                except StepAbandoned:  # a stop before the step's first update: nothing changed
                    self.optimizer.zero_grad(set_to_none=True)
                    self.dataloader.load_state_dict(position)  # trained after the resume
                    return self._abandoned()
                step = self.state.step
                if profiler is not None:
                    profiler.step()
                snapshots.step(step)
                gc_control.step(step)
                report.step_done(step)  # before its eval and save: the ETA's pace includes them
                if step == first_step and self.info.world_size > 1:
                    self._shorten_timeouts()  # init is over
                outcome = self._after_step(step, out, report)
                if outcome is not None:
                    return outcome
        return Outcome(Status.FINISHED, exit_codes.OK, "")

    def _after_step(self, step: int, out: StepResult, report: StepMetrics) -> Outcome | None:
        """Metrics, eval, divergence and checkpoint after global step ``step``; an Outcome to stop."""
        self._report(step, out, report)
        abort = self.divergence.after_step(
            step, out.skip_reason, model_finite(self.model), out.non_finite
        )
        if abort:
            return self._diverged(abort)
        return self._save_or_stop(step, last=step == self.cfg.training.steps, healthy=out.healthy)

    def _report(self, step: int, out: StepResult, report: StepMetrics) -> None:
        """The step's record and console line, with the held-out eval and downstream scores due."""
        t = self.cfg.training
        scalars = (
            report.train_scalars(step, out, self.state.tokens_seen)
            if report.is_log_step(step, t.steps, out.skip_reason is not None)
            else {}
        )
        routing = None
        if self.held_out.due(step, t.steps):
            with report.paused():  # tokens/s counts training time only
                eval_scalars, routing = self.held_out.validate(step)
            scalars.update(eval_scalars or {})
        console = bool(scalars)  # downstream scores have their own lines, diagnostics none
        if self.downstream is not None and self.downstream.due(step, t.steps):
            with report.paused():
                scalars.update(self.downstream.score(step) or {})
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
        if self.info.rank == 0:
            write_abort(self.cfg.job.dump_folder, abort)
        return Outcome(Status.DIVERGED, exit_codes.BAD_INPUT, abort)

    def _abandoned(self) -> Outcome:
        """A stop agreed before the step's first update: save the step before it (if any)."""
        step = self.state.step
        if step:
            return self._save_or_stop(step, last=True, healthy=False)
        code = self.stop_signals.exit_code()
        return Outcome(Status.STOPPED, code, f"stopped before step {step + 1}")

    def _save_or_stop(self, step: int, *, last: bool, healthy: bool) -> Outcome | None:
        """Save what the checkpoint policy asks for (``healthy``: this step proves the checkpoint
        before it); when the stop signals (or exit_after_step) stop the run here, this step is
        saved and the Outcome's line says so."""
        reason = self.stop_signals.stop_after(step, last=last)
        stopping = reason is not None
        where = self.checkpointer.after_step(step, last=last, stopping=stopping, healthy=healthy)
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
            cfg.comm.train_timeout_seconds, dist_utils.mesh_groups(self.parallel_dims)
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
            self.metrics.close()
        except OSError as exc:  # e.g. the last flush of a full disk
            if not outcome.error:
                outcome = launch.outcome_of(exc, self.cfg, self.state.step)
        if outcome.error:
            for line in outcome.message.splitlines():
                print(line, file=sys.stderr)
        else:
            if outcome.message:
                self.log(outcome.message)
            dump, last_eval = self.cfg.job.dump_folder, self.held_out.last
            self.log(final_line(self.state.step, outcome.exit_code, dump, last_eval))
        if self.launch_recorded:
            launch.record_end(self.cfg, self.run_id, outcome.status.value, self.state.step)
        return outcome


def main(argv: list[str] | None = None) -> int:
    """``python -m torchtitan_loom.train [--help] [--check-config] [--section.key value ...]``."""
    return launch.run(sys.argv[1:] if argv is None else argv, Trainer)


if __name__ == "__main__":
    sys.exit(main())
