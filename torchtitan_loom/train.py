"""The trainer: config → model on meta → parallelize → init → optimizer, data, metrics → loop.

Read top to bottom: ``Trainer.__init__`` builds everything in TorchTitan order, ``train_step`` is
LOOM's segmented step (LOOM_SPEC §6 with the §14 decisions), ``evaluate`` runs the held-out loss
after every loop, ``train`` is the loop, ``main`` turns config errors into exit code 2.

Legend: B rows, S sequence length, L layers, H loops, T loops of a segment, E routed experts.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from typing import Any

import torch

from torchtitan_loom.components.checkpoint import CheckpointError, CheckpointManager
from torchtitan_loom.components.data import build_eval_loader, build_train_loader, bundled_corpus_path
from torchtitan_loom.components.float8 import build_float8_converter
from torchtitan_loom.components.loss import count_valid, token_ce_sum
from torchtitan_loom.components.lr_scheduler import build_lr_scheduler
from torchtitan_loom.components.metrics import MetricsLogger, format_console_line, memory_stats, peak_flops
from torchtitan_loom.components.optimizer import build_optimizer, update_expert_bias
from torchtitan_loom.components.spike_guard import SpikeGuard
from torchtitan_loom.config import ConfigError, JobConfig, help_text, load_config, to_toml
from torchtitan_loom.config.validate import validate
from torchtitan_loom.distributed import utils as dist_utils
from torchtitan_loom.distributed.parallel_dims import ParallelDims
from torchtitan_loom.models.loom.attention import flash_attn_available, resolve_attn_backend
from torchtitan_loom.models.loom.moe import moe_gemm_fallbacks
from torchtitan_loom.protocols import get_train_spec

SPIKE_EXIT_CODE = 2
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def segments(num_loops: int, seg_len: int) -> list[tuple[int, int]]:
    """1-based inclusive loop ranges of the backprop segments; seg_len 0 = one segment."""
    if seg_len <= 0 or seg_len >= num_loops:
        return [(1, num_loops)]
    return [(a, min(a + seg_len - 1, num_loops)) for a in range(1, num_loops + 1, seg_len)]


class TrainState:
    """Step counters that must survive a restart (Stateful)."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0
        self.skipped_segments = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_segments": self.skipped_segments}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])
        self.skipped_segments = int(sd.get("skipped_segments", 0))


class Trainer:
    def __init__(self, cfg: JobConfig, model_args: Any, info: dist_utils.DistInfo) -> None:
        self.cfg, self.info, self.device = cfg, info, info.device
        self.model_args = model_args
        t = cfg.training
        dist_utils.set_determinism(t.seed, t.deterministic)
        self.compute_dtype = _DTYPES[t.mixed_precision_param]
        self.reduce_dtype = _DTYPES[t.mixed_precision_reduce]

        # Degrees and meshes first: every divisibility rule was already checked by validate().
        self.parallel_dims = ParallelDims.from_config(cfg.parallelism, info.world_size,
                                                      num_experts=model_args.num_routed_experts)
        self.parallel_dims.build_meshes(self.device.type)
        # FSDP's MixedPrecisionPolicy casts the parameters; autocast would only add casts on top.
        self.use_autocast = self.compute_dtype != torch.float32 and not self.parallel_dims.fsdp_enabled

        # Model: meta → (converters) → parallelize → materialise → layout-independent init.
        self.spec = get_train_spec(cfg.model.name)
        with torch.device("meta"):
            model = self.spec.model_cls(model_args)
        self.float8 = build_float8_converter(cfg.float8, t.device)  # None unless float8.enable
        if self.float8 is not None:
            self.log(self.float8.convert(model).summary(self.float8.plan))
        if self.spec.parallelize_fn is not None:
            model = self.spec.parallelize_fn(model, self.parallel_dims, cfg)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights()
        self.model = model.train()
        # Tensorwise float8 scale precompute: only when FSDP sharded the float8 weights.
        self.float8_precompute = self.float8 is not None and self.float8.precompute_applies(model)
        if self.float8_precompute:
            self.log("float8: FSDP shards the float8 weights; their scales are precomputed after each optimizer step")
        attention = resolve_attn_backend(model_args.attn_backend, self.device.type, self.compute_dtype,
                                         flash_attn_available())
        self.log(f"attention backend: {attention} (attn_backend={model_args.attn_backend})")
        for line in moe_gemm_fallbacks(model.moe_layers(), self.device.type, self.compute_dtype, cfg.compile.enable):
            self.log(line)  # once per layer, at start: the path is a function of static inputs
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.num_loops = model.num_loops
        self.segments = segments(self.num_loops, t.bp_segment_len)
        counts = model.param_counts()

        o, s, g = cfg.optimizer, cfg.lr_scheduler, cfg.spike_guard
        self.optimizer = build_optimizer(model, lr=o.lr, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                                         weight_decay=o.weight_decay, implementation=o.implementation)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, total_steps=t.steps, warmup_ratio=s.warmup_ratio,
                                               decay_ratio=s.decay_ratio, min_ratio=s.min_ratio, kind=s.kind)
        self.spike_guard = SpikeGuard(enabled=g.enable, delta=g.delta, rel=g.rel, ratio=g.ratio, hard=g.hard,
                                      ema=g.ema, warmup_steps=g.warmup_steps)
        self.state = TrainState()

        data_path = cfg.data.path or bundled_corpus_path(cfg.data.cache_dir or None)
        self.data_path = data_path
        self.vocab_size = model_args.vocab_size
        self.dataloader = build_train_loader(data_path, seq_len=t.seq_len, vocab_size=model_args.vocab_size,
                                             global_batch_rows=t.global_batch_size, dp_rank=info.rank,
                                             dp_world=self.parallel_dims.dp)  # every rank is a dp rank
        self.metrics = MetricsLogger(cfg.job.dump_folder, enable_tensorboard=cfg.metrics.enable_tensorboard,
                                     tb_folder=cfg.metrics.tb_folder, rank=info.rank,
                                     log_rank=cfg.metrics.log_rank)
        # The head runs once per segment, so it counts once per segment (see the model docstring).
        self.flops_per_token = model.flops_per_token(t.seq_len, head_calls=len(self.segments))
        self.peak_flops = peak_flops(self.device)
        self.log(f"model {cfg.model.name}/{cfg.model.flavor}: {counts['total']:,} parameters "
                 f"({counts['active']:,} active per token), H={self.num_loops}, segments={self.segments}, "
                 f"world={info.world_size}, device={self.device}, compute dtype={t.mixed_precision_param}, "
                 f"data={data_path}")
        if info.world_size > 1:
            self.log("parallelism: " + "; ".join(line.strip() for line in self.parallel_dims.describe().splitlines())
                     + f"; activation_checkpoint={cfg.activation_checkpoint.mode}, compile={cfg.compile.enable}")
        # Built last, once everything it saves exists; resumes (or warm-starts) right away.
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, dump_folder=cfg.job.dump_folder, model=self.model, optimizer=self.optimizer,
            states={"lr_scheduler": self.lr_scheduler, "dataloader": self.dataloader,
                    "spike_guard": self.spike_guard, "train_state": self.state},
            model_args=model_args, model_name=cfg.model.name, flavor=cfg.model.flavor, config_toml=to_toml(cfg),
            total_steps=t.steps, device=self.device, rank=info.rank, world_size=info.world_size, log=self.log)
        self.checkpointer.load()

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
        return [{k: v[i:i + mb].to(self.device, non_blocking=True) for k, v in batch.items()}
                for i in range(0, rows, mb)]

    # ---------------------------------------------------------------- the step
    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One global step: ⌈H/K⌉ segments, each zero_grad → fwd/bwd per micro-batch → guard → clip → AdamW."""
        micro = self.micro_batches(batch)
        # The divisor of every micro-batch loss: valid targets of the whole GLOBAL batch, so the
        # summed gradient is the token mean whatever the world size and micro-batching (§14).
        # Kept on the device (read with segment 1's statistics, no sync of its own); an integer
        # < 2^24 is exact in fp32, so ce_sum / denom_t equals the division by the Python count.
        n_valid_t = dist_utils.all_reduce(sum(count_valid(m["labels"]) for m in micro).to(torch.float64)
                                          .reshape(1))
        denom_t = n_valid_t.clamp_min(1.0)
        num_dp = self.info.world_size
        carries: list[Any] = [None] * len(micro)
        args = self.model_args
        counts_LHE = torch.zeros(args.n_layers, self.num_loops, args.num_routed_experts, dtype=torch.int64,
                                 device=self.device)
        seg_losses: list[float] = []
        grad_norm, skip_reason = float("nan"), None
        for j, (a, b) in enumerate(self.segments):
            self.optimizer.zero_grad(set_to_none=True)
            ce_total = torch.zeros((), dtype=torch.float64, device=self.device)
            for m, mb in enumerate(micro):
                with self.autocast():
                    out = self.model(mb["input_ids"], mb["positions"], mb["doc_ids"],
                                     loop_start=a, loop_end=b, carry=carries[m])
                ce_sum = token_ce_sum(out.logits_BSV, mb["labels"])
                loss = ce_sum / denom_t.to(ce_sum.dtype).reshape(()) + out.aux_loss / (len(micro) * num_dp)
                loss.backward()
                carries[m] = out.carry.detach()  # truncated BPTT: the next segment starts from values
                ce_total += ce_sum.detach().double()
                counts_LHE[:, a - 1:b] += out.counts_LTE
            # Sums what FSDP did not reduce: every gradient of a replicated model, or only the
            # replicated routers under FSDP (its reduce-scatter already summed the rest).
            dist_utils.reduce_gradients(self.params, self.reduce_dtype)
            # The segment's one host sync: [loss sum, grad-norm², non-finite flag] from ONE small
            # all-reduce, read together with n_valid; the guard and the clip both use it.
            stats = dist_utils.step_statistics(self.params, ce_total)
            loss_sum, norm_sq, non_finite, n_valid = torch.cat([stats, n_valid_t]).tolist()
            seg_loss = loss_sum / max(n_valid, 1.0)
            seg_losses.append(seg_loss)
            skip_reason = self.spike_guard.check(j, seg_loss, non_finite == 0, self.state.step + 1)
            if skip_reason is not None:
                self.optimizer.zero_grad(set_to_none=True)
                self.state.skipped_segments += 1
                skip_reason = f"segment {j + 1} (loops {a}-{b}): {skip_reason}"
                break
            dist_utils.clip_grads_with_total_norm(self.params, stats[dist_utils.STAT_GRAD_NORM_SQ],
                                                  self.cfg.training.max_norm)
            grad_norm = math.sqrt(norm_sq) if math.isfinite(norm_sq) else float("nan")
            self.optimizer.step()
            if self.float8_precompute:
                self.float8.post_optimizer_hook(self.model)
            self.spike_guard.accept(j, seg_loss)
        # Expert-bias update once per global step, loads summed over loops, micro-batches and
        # ranks; discarded when a segment was skipped (§5.2).
        counts_LHE = dist_utils.all_reduce(counts_LHE)
        if skip_reason is None:
            update_expert_bias(self.model.moe_layers(), counts_LHE.sum(1), self.model_args.load_balance_bias_lr)
        lr = self.optimizer.param_groups[0]["lr"]
        self.lr_scheduler.step()
        self.state.step += 1
        self.state.tokens_seen += int(n_valid)
        return {"seg_losses": seg_losses, "grad_norm": grad_norm, "lr": lr, "skip_reason": skip_reason,
                "counts_LHE": counts_LHE, "n_valid": n_valid}

    # -------------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Full H loops on the holdout; the loss after every loop comes from running the loops one
        at a time with the carry, which equals the full forward (tested by the model)."""
        cfg, t = self.cfg, self.cfg.training
        loader = build_eval_loader(self.data_path, seq_len=t.seq_len, vocab_size=self.vocab_size,
                                   batch_rows=cfg.eval.batch_size or t.global_batch_size, dp_rank=self.info.rank,
                                   dp_world=self.info.world_size, val_path=cfg.data.val_path or None,
                                   max_tokens=cfg.eval.tokens)
        self.model.eval()
        ce_H = torch.zeros(self.num_loops, dtype=torch.float64, device=self.device)
        n_tok = torch.zeros(1, dtype=torch.float64, device=self.device)
        for batch in loader:
            for mb in self.micro_batches(batch):
                carry = None
                for loop in range(1, self.num_loops + 1):
                    with self.autocast():
                        out = self.model(mb["input_ids"], mb["positions"], mb["doc_ids"],
                                         loop_start=loop, loop_end=loop, carry=carry)
                    carry = out.carry
                    ce_H[loop - 1] += token_ce_sum(out.logits_BSV, mb["labels"]).double()
                n_tok += count_valid(mb["labels"])
        self.model.train()
        dist_utils.all_reduce(ce_H)
        dist_utils.all_reduce(n_tok)
        losses = (ce_H / n_tok.clamp(min=1)).tolist()
        result = {"eval_loss": losses[-1], "eval_tokens": int(n_tok.item())}
        result.update({f"eval_loss_loop_{i + 1}": v for i, v in enumerate(losses)})
        return result

    # -------------------------------------------------------------------- loop
    def train(self) -> int:
        cfg, t = self.cfg, self.cfg.training
        data_iter = iter(self.dataloader)
        self.checkpointer.restore_rng()  # the resumed RNG stream, untouched by anything built since
        tokens_per_step = t.global_batch_size * t.seq_len
        last_time, last_step = time.perf_counter(), self.state.step
        exit_code = 0
        while self.state.step < t.steps:
            out = self.train_step(next(data_iter))
            step = self.state.step
            scalars: dict[str, Any] = {}
            if step % cfg.metrics.log_freq == 0 or step == t.steps or out["skip_reason"]:
                now = time.perf_counter()
                tps = tokens_per_step * (step - last_step) / max(now - last_time, 1e-9)
                last_time, last_step = now, step
                tflops = tps * self.flops_per_token / 1e12
                scalars = {"loss": out["seg_losses"][-1], "lr": out["lr"], "grad_norm": out["grad_norm"],
                           "tokens_per_s": tps, "tflops": tflops,
                           "mfu": (100.0 * tflops * 1e12 / self.peak_flops) if self.peak_flops else None,
                           "skipped": int(out["skip_reason"] is not None), "tokens_seen": self.state.tokens_seen}
                scalars.update({f"loss_segment_{j + 1}": v for j, v in enumerate(out["seg_losses"])})
                scalars.update(memory_stats(self.device))
            if cfg.eval.interval and (step % cfg.eval.interval == 0 or step == t.steps):
                scalars.update(self.evaluate())
            if scalars:
                extra = {"expert_load": out["counts_LHE"].tolist()}
                self.metrics.log(step, scalars, extra)
                self.log(format_console_line(step, scalars))
            if out["skip_reason"]:
                self.log(f"step {step}: skipped {out['skip_reason']}")
                if cfg.spike_guard.abort_on_spike:
                    self._write_spike_abort(step, out["skip_reason"])
                    exit_code = SPIKE_EXIT_CODE
                    self.checkpointer.after_step(step, last=True)
                    break
            stop = self.checkpointer.after_step(step, last=step == t.steps)  # saves; preemption → stop
            if stop:
                self.log(stop)
                break
        self.checkpointer.close()
        self.metrics.close()
        return exit_code

    def _write_spike_abort(self, step: int, reason: str) -> None:
        msg = (f"loss spike at step {step}: {reason}; stopping (spike_guard.abort_on_spike=true). "
               f"Set --spike_guard.abort_on_spike false to skip spikes and continue.")
        self.log(msg)
        if self.info.rank == 0:
            with open(os.path.join(self.cfg.job.dump_folder, "SPIKE_ABORT.txt"), "w") as fh:
                fh.write(msg + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    check_only = "--check-config" in argv
    argv = [a for a in argv if a != "--check-config"]
    try:
        cfg = load_config(argv)
        world_size = cfg.parallelism.dry_run_world_size or dist_utils.world_size_from_env()
        model_args = validate(cfg, world_size)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"config error: {line}", file=sys.stderr)
        return 2
    if check_only:  # run_train.sh checks the config for the whole world before starting ranks
        return 0
    if cfg.parallelism.dry_run:  # the layout for world_size ranks, in this one process
        from torchtitan_loom.distributed.dry_run import dry_run

        if int(os.environ.get("RANK", "0")) == 0:
            print(dry_run(cfg, model_args, world_size))
        return 0
    info = dist_utils.init_distributed(cfg.training.device)
    finished = False
    try:
        os.makedirs(cfg.job.dump_folder, exist_ok=True)
        if cfg.job.print_config and info.rank == cfg.metrics.log_rank:
            print(to_toml(cfg))
        try:
            trainer = Trainer(cfg, model_args, info)
        except CheckpointError as exc:  # the checkpoint to resume does not fit this run
            for line in str(exc).splitlines():
                print(f"checkpoint error: {line}", file=sys.stderr)
            return 2
        if info.rank == 0:  # written after the resume succeeded, so a refused one leaves the run as it was
            with open(os.path.join(cfg.job.dump_folder, "config.toml"), "w") as fh:
                fh.write(to_toml(cfg))
        code = trainer.train()
        trainer.log(f"done: {trainer.state.step} steps, exit code {code}")
        finished = True
        return code
    finally:
        dist_utils.destroy_distributed(wait_for_all=finished)


if __name__ == "__main__":
    sys.exit(main())
