"""The trainer: config → model on meta → parallelize → init → optimizer, data, metrics → loop.

Read top to bottom: ``Trainer.__init__`` builds everything in TorchTitan order, ``train_step`` is
LOOM's segmented step (LOOM_SPEC §6 with the §14 decisions), ``train`` loads the checkpoint and runs
the loop. Around it: the held-out eval is components/evaluation/held_out.py, the step's metrics
components/observability/step_metrics.py, stop signals components/runtime/preemption.py, and the launch with its exit
codes launch.py (``main`` here). The model is reached only through ``protocols.ModelProtocol``.

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
from torchtitan_loom.components.runtime import exit_codes, safe_files
from torchtitan_loom.components.checkpoint import CheckpointManager
from torchtitan_loom.components.checkpoint.integrity import model_finite
from torchtitan_loom.components.data import build_train_loader, bundled_corpus_path
from torchtitan_loom.components.observability.diagnostics import build_diagnostics
from torchtitan_loom.components.optim.divergence import DivergenceMonitor, write_abort
from torchtitan_loom.components.evaluation.downstream import build_scorer
from torchtitan_loom.components.quantization.float8 import build_float8_converter
from torchtitan_loom.components.runtime.gc_control import GarbageCollection
from torchtitan_loom.components.loss import count_valid, token_ce_sum
from torchtitan_loom.components.optim.lr_scheduler import build_lr_scheduler, extension_note
from torchtitan_loom.components.observability.metrics import MetricsLogger, peak_flops
from torchtitan_loom.components.optim.optimizer import apply_config_hyperparameters, build_optimizer
from torchtitan_loom.components.runtime.preemption import PreemptionWatcher
from torchtitan_loom.components.observability.profiling import MemorySnapshotter, maybe_profile
from torchtitan_loom.components.observability.progress import start_report
from torchtitan_loom.components.runtime.run_folder import new_run_id, record_launch
from torchtitan_loom.components.optim.spike_guard import SpikeGuard
from torchtitan_loom.components.observability.step_metrics import StepMetrics
from torchtitan_loom.components.runtime.train_state import StepAbandoned, StepResult, TrainState
from torchtitan_loom.components.evaluation.held_out import HeldOutEval
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
        model_args = self.model_args
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

        # Model: meta → (converters) → parallelize → materialise → layout-independent init.
        self.spec = get_train_spec(cfg.model.name)
        with torch.device("meta"):
            model = self.spec.model_cls(model_args)
        if (
            info.rank == cfg.metrics.log_rank
        ):  # within seconds of start, before anything is allocated
            for line in start_report(
                cfg,
                self.parallel_dims,
                model,
                len(segments(model.num_loops, t.bp_segment_len)),
                self.device,
                self.compute_dtype,
                cost_fn=self.spec.cost_fn,
            ):
                self.log(line)
        self.float8 = build_float8_converter(
            cfg.float8, t.device, self.spec, t.micro_batch_size * t.seq_len
        )  # None unless float8.enable
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
        self.model: ModelProtocol = model.train()
        # Tensorwise float8 scale precompute: only when FSDP sharded the float8 weights.
        self.float8_precompute = self.float8 is not None and self.float8.precompute_applies(model)
        if self.float8_precompute:
            self.log(
                "float8: FSDP shards the float8 weights; their scales are precomputed after each optimizer step"
            )
        if (
            self.spec.kernel_report_fn is not None
        ):  # which kernels the model picked here, said once at start
            for line in self.spec.kernel_report_fn(
                model, self.device.type, self.compute_dtype, cfg.compile.enable
            ):
                self.log(line)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.num_loops = model.num_loops
        self.segments = segments(self.num_loops, t.bp_segment_len)
        self.diagnostics = build_diagnostics(cfg.metrics, model, len(self.segments), self.device)
        counts = model.param_counts()

        s = cfg.lr_scheduler
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

        data_path = cfg.data.path or bundled_corpus_path(cfg.data.cache_dir or None, log=self.log)
        self.data_path = data_path
        self.vocab_size = model.args.vocab_size
        self.tokenizer_name = cfg.data.tokenizer or None  # checked against the pack's own record
        self.dataloader = build_train_loader(
            data_path,
            seq_len=t.seq_len,
            vocab_size=self.vocab_size,
            global_batch_rows=t.global_batch_size,
            dp_rank=info.rank,
            dp_world=self.parallel_dims.dp,
            tokenizer_name=self.tokenizer_name,
        )
        self.metrics = MetricsLogger(
            cfg.job.dump_folder,
            cfg.metrics,
            rank=info.rank,
            run_id=self.run_id,
            wandb_config=cfg.to_dict(),
        )
        # The head runs once per segment, so it counts once per segment (see the model docstring).
        self.flops_per_token = model.flops_per_token(t.seq_len, head_calls=len(self.segments))
        self.log(
            f"model {cfg.model.name}/{cfg.model.flavor}: {counts['total']:,} parameters "
            f"({counts['active']:,} active per token), H={self.num_loops}, segments={self.segments}, "
            f"world={info.world_size}, device={self.device}, compute dtype={t.mixed_precision_param}, "
            f"init seed={model.args.init_seed} (training.seed), data={data_path}"
        )
        if info.world_size > 1:
            self.log(
                "parallelism: "
                + "; ".join(line.strip() for line in self.parallel_dims.describe().splitlines())
                + f"; activation_checkpoint={cfg.activation_checkpoint.mode}, compile={cfg.compile.enable}"
            )
        # Built last, once everything they watch or save exists; train() loads (TorchTitan's order).
        ck = cfg.checkpoint
        self.stop_signals = PreemptionWatcher(
            ck.enable and ck.save_on_signal,
            self.device,
            exit_after_step=ck.exit_after_step if ck.enable else 0,
        )
        self.held_out = HeldOutEval(
            cfg.eval,
            model=self.model,
            data_path=data_path,
            val_path=cfg.data.val_path or None,
            seq_len=t.seq_len,
            vocab_size=self.vocab_size,
            batch_rows=t.global_batch_size,
            dp_rank=info.rank,
            dp_world=self.parallel_dims.dp,
            tokenizer_name=self.tokenizer_name,
            device=self.device,
            micro_batches=self.micro_batches,
            autocast=self.autocast,
            stop_requested=self.stop_signals.requested,
            log=self.log,
        )
        self.downstream = build_scorer(
            cfg.eval,
            model=self.model,
            data_path=data_path,
            tokenizer_name=self.tokenizer_name,
            vocab_size=self.vocab_size,
            device=self.device,
            autocast=self.autocast,
            stop_requested=self.stop_signals.requested,
            log=self.log,
        )
        self.resumed, self.resumed_from = False, None
        self.launch_recorded = False  # run.json says "running" for this launch (rank 0)
        self.checkpointer = CheckpointManager(
            ck,
            dump_folder=cfg.job.dump_folder,
            model=self.model,
            optimizer=self.optimizer,
            states={
                "lr_scheduler": self.lr_scheduler,
                "dataloader": self.dataloader,
                "spike_guard": self.spike_guard,
                "train_state": self.state,
            },
            model_args=model_args,
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
        """One global step: ⌈H/K⌉ segments, each zero_grad → fwd/bwd per micro-batch → guard → clip → AdamW."""
        micro = self.micro_batches(batch)
        # The divisor of every micro-batch loss: valid targets of the whole GLOBAL batch, so the
        # summed gradient is the token mean whatever the world size and micro-batching (§14).
        # Kept on the device (read with segment 1's statistics, no sync of its own); an integer
        # < 2^24 is exact in fp32, so ce_sum / denom_t equals the division by the Python count.
        n_valid_t = dist_utils.all_reduce(
            sum(count_valid(m["labels"]) for m in micro).to(torch.float64).reshape(1)
        )
        denom_t = n_valid_t.clamp_min(1.0)
        num_dp = self.parallel_dims.dp
        carries: list[Any] = [None] * len(micro)
        n_layers, n_experts = self.model.routing or (0, 0)
        counts_LHE = torch.zeros(
            n_layers, self.num_loops, n_experts, dtype=torch.int64, device=self.device
        )
        seg_losses: list[float] = []
        grad_norm, skip_reason, n_valid, non_finite_in = None, None, 0.0, None
        diag = self.diagnostics.begin(self.state.step + 1)  # None on most steps: nothing extra
        for j, (a, b) in enumerate(self.segments):
            self.optimizer.zero_grad(set_to_none=True)
            ce_total = torch.zeros((), dtype=torch.float64, device=self.device)
            for m, mb in enumerate(micro):
                # No update yet: a stop abandons the step. Free on one process; with several the
                # ranks agree through segment 1's statistics below (no collective per micro-batch).
                if j == 0 and not self.info.world_size > 1 and self.stop_signals.requested():
                    raise StepAbandoned
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
                loss = ce_sum / denom_t.to(ce_sum.dtype).reshape(()) + out.aux_loss / (
                    len(micro) * num_dp
                )
                loss.backward()
                carries[m] = (
                    out.carry.detach()
                )  # truncated BPTT: the next segment starts from values
                ce_total += ce_sum.detach().double()
                if out.counts_LTE is not None:
                    counts_LHE[:, a - 1 : b] += out.counts_LTE
                if diag is not None:
                    diag.add_forward(a, out.observed_LTNK)
            # Sums what the parallel wrappers did not reduce (the parallelize seam knows which).
            self.finish_gradients()
            if diag is not None:
                diag.add_gradients(j, self.params)
            # The segment's one host sync (read with n_valid); the guard and the clip both use it.
            # The stop flag rides along, so the ranks agree on a stop without a sync of its own.
            signal_flag = torch.tensor(
                [float(self.stop_signals.received > 0)], dtype=torch.float64, device=self.device
            )
            stats = dist_utils.step_statistics(self.params, ce_total, signal_flag, n_valid_t)
            n_valid = stats.n_valid
            if j == 0 and stats.stop_flag:  # before the step's first update: nothing changed yet
                self.stop_signals.agree()
                raise StepAbandoned
            seg_loss = stats.loss_sum / max(n_valid, 1.0)
            seg_losses.append(seg_loss)
            # A non-finite loss or gradient is never stepped on, whatever the guard says; the loop then
            # stops the run (only finite spikes are skipped and trained past).
            bad = (
                "loss" if not math.isfinite(seg_loss) else "gradient" if stats.non_finite else None
            )
            if bad:
                non_finite_in = f"non-finite {bad} in segment {j + 1} (loops {a}-{b})"
                skip_reason = f"non-finite {bad}"
            else:
                skip_reason = self.spike_guard.check(j, seg_loss, True, self.state.step + 1)
            if skip_reason is not None:
                self.optimizer.zero_grad(set_to_none=True)
                self.state.skipped_segments += 1
                skip_reason = f"segment {j + 1} (loops {a}-{b}): {skip_reason}"
                break
            dist_utils.clip_grads_with_total_norm(
                self.params, stats.grad_norm_sq_t, self.cfg.training.max_norm
            )
            norm_sq = stats.grad_norm_sq
            grad_norm = (
                math.sqrt(norm_sq) if math.isfinite(norm_sq) else float("nan")
            )  # pre-clip norm
            self.optimizer.step()
            if self.float8_precompute:
                self.float8.post_optimizer_hook(self.model)
            self.spike_guard.accept(j, seg_loss)
        # The model's after-step update (LOOM: expert bias, §5.2) once per global step, from the
        # counts summed over loops, micro-batches and ranks; none when a segment was skipped. A
        # model without routed experts has no counts to sum (no collective).
        if self.model.routing is not None:
            counts_LHE = dist_utils.all_reduce(counts_LHE)
        if skip_reason is None and isinstance(self.model, UpdatesAfterStep):
            self.model.after_step(counts_LHE.sum(1))
        lr = self.optimizer.param_groups[0]["lr"]
        self.lr_scheduler.step()
        self.state.step += 1
        self.state.tokens_seen += int(n_valid)
        return StepResult(
            seg_losses=seg_losses,
            grad_norm=grad_norm,
            lr=lr,
            skip_reason=skip_reason,
            counts_LHE=counts_LHE,
            n_valid=n_valid,
            non_finite=non_finite_in,
            diag=None if diag is None else diag.finish(),
        )

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
        if (
            self.info.rank == 0
        ):  # after the resume succeeded, so a refused one leaves the run as it was
            safe_files.atomic_write(os.path.join(cfg.job.dump_folder, "config.toml"), to_toml(cfg))
            record_launch(cfg, self.run_id, "running", self.state.step, resumed)
            self.launch_recorded = True

    def train(self) -> int:
        """Run the steps left; returns the exit code (0 also after a stop that saved)."""
        cfg, t = self.cfg, self.cfg.training
        if not self.resumed:
            self.resume()
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
        divergence = DivergenceMonitor(
            cfg.spike_guard.abort_on_spike, cfg.spike_guard.max_consecutive_skips
        )
        tools = (
            contextlib.ExitStack()
        )  # profiler, memory snapshots and GC control, closed when the loop ends
        profiler = tools.enter_context(
            maybe_profile(
                cfg.profiling,
                cfg.job.dump_folder,
                self.info.rank,
                self.log,
                step_offset=self.state.step,
            )
        )
        snapshots = MemorySnapshotter(
            cfg.profiling, cfg.job.dump_folder, self.info.rank, self.device, self.log
        )
        tools.callback(snapshots.close)
        gc_control = GarbageCollection(t.gc_freq)
        tools.callback(gc_control.close)  # automatic GC back on, also when the loop raises
        exit_code, first_step = None, self.state.step + 1
        with tools:
            while exit_code is None and self.state.step < t.steps:
                position = self.dataloader.state_dict()
                try:
                    out = self.train_step(next(data_iter))
                except (
                    StepAbandoned
                ):  # a stop signal before the step's first update: nothing changed
                    self.optimizer.zero_grad(set_to_none=True)
                    self.dataloader.load_state_dict(
                        position
                    )  # the batch is trained after the resume
                    stop = (
                        self._save_or_stop(self.state.step, last=True) if self.state.step else None
                    )
                    self.log(stop or f"stopped before step {self.state.step + 1}")
                    exit_code = self.stop_signals.exit_code()
                    break
                step = self.state.step
                if profiler is not None:
                    profiler.step()
                snapshots.step(step)
                gc_control.step(step)
                report.step_done(step)  # before its eval and save: the ETA's pace includes them
                if step == first_step and self.info.world_size > 1:
                    self._shorten_timeouts()  # init is over
                exit_code = self._after_step(step, out, report, divergence)
        self.close()
        return exit_codes.OK if exit_code is None else exit_code

    def _after_step(
        self, step: int, out: StepResult, report: StepMetrics, divergence: DivergenceMonitor
    ) -> int | None:
        """Metrics, eval, divergence and checkpoint after global step ``step``; an exit code to stop."""
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
        abort = divergence.after_step(
            step, out.skip_reason, model_finite(self.model), out.non_finite
        )
        if (
            out.skip_reason and divergence.streak_started
        ):  # the last good checkpoint survives pruning
            kept = self.checkpointer.protect_newest()
            if kept:
                self.log(f"first skipped step of a streak: {kept} is kept (never pruned)")
        if abort:  # never saved: the step may hold the diverged update
            self.log(abort)
            if self.info.rank == 0:
                write_abort(self.cfg.job.dump_folder, abort)
            return exit_codes.BAD_INPUT
        stop = self._save_or_stop(step, last=step == t.steps)
        if stop:
            self.log(stop)
            return self.stop_signals.exit_code()
        return None

    def _save_or_stop(self, step: int, *, last: bool) -> str | None:
        """Save what the checkpoint policy asks for; when the stop signals (or exit_after_step) stop
        the run here, this step is saved and the returned line says so."""
        reason = self.stop_signals.stop_after(step, last=last)
        where = self.checkpointer.after_step(step, last=last, stopping=reason is not None)
        if reason is None:
            return None
        saved = f"saved {where}" if where else "nothing saved (checkpoints off)"
        return f"{reason}, {saved}; {self.stop_signals.exit_note(saved=bool(where))}"

    def _shorten_timeouts(self) -> None:
        cfg = self.cfg
        now_s = dist_utils.set_pg_timeouts(
            cfg.comm.train_timeout_seconds, dist_utils.mesh_groups(self.parallel_dims)
        )
        self.log(
            f"comm: collective timeout {cfg.comm.init_timeout_seconds} s during init, "
            f"{min(now_s):g} s from step 2 on ({len(now_s)} process groups)"
        )

    def close(self) -> None:
        """Finish in-flight saves, put the signal handlers back, close the metrics files."""
        self.checkpointer.close()
        self.stop_signals.close()
        self.metrics.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m torchtitan_loom.train [--help] [--check-config] [--section.key value ...]``."""
    return launch.run(sys.argv[1:] if argv is None else argv, Trainer)


if __name__ == "__main__":
    sys.exit(main())
