"""What the Trainer builds, in TorchTitan's order: the model (meta → converters → parallelize →
materialise → init), what training needs (segments, optimizer, schedule, guards, data, metrics) and
the services around it (stop signals, evals, checkpoints). ``TrainerBuild`` is a base of
``train.Trainer``, whose ``__init__`` calls the three builders in turn; they set the Trainer's
attributes that the step (trainer_step.py) and the loop (train.py) read. The model is reached only
through ``protocols.ModelProtocol``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_loom.components.checkpoint import CheckpointManager
from torchtitan_loom.components.data import build_train_loader, bundled_corpus_path
from torchtitan_loom.components.evaluation.downstream import build_scorer
from torchtitan_loom.components.evaluation.held_out import HeldOutEval
from torchtitan_loom.components.observability.diagnostics import (
    BranchDiagnostics,
    build_diagnostics,
)
from torchtitan_loom.components.observability.metrics import MetricsLogger
from torchtitan_loom.components.observability.progress import start_report
from torchtitan_loom.components.optim.divergence import DivergenceMonitor
from torchtitan_loom.components.optim.lr_scheduler import build_lr_scheduler
from torchtitan_loom.components.optim.optimizer import build_optimizer
from torchtitan_loom.components.optim.spike_guard import SpikeGuard
from torchtitan_loom.components.quantization.float8 import (
    Float8Converter,
    build_float8_converter,
)
from torchtitan_loom.components.runtime.preemption import PreemptionWatcher
from torchtitan_loom.components.runtime.train_state import TrainState
from torchtitan_loom.config import JobConfig, to_toml
from torchtitan_loom.depth_sampling import BEYOND_POLICY, DepthSampler, depth_key, training_depth
from torchtitan_loom.depth_sampling import flops_per_token as expected_flops
from torchtitan_loom.distributed import utils as dist_utils
from torchtitan_loom.distributed.model_wrappers import apply_checkpoint_and_compile
from torchtitan_loom.distributed.parallel_dims import ParallelDims
from torchtitan_loom.protocols import ExitsPerToken, ModelProtocol, TrainSpec
from torchtitan_loom.trainer_step import SegmentedStep, StepParts


class TrainerBuild:
    """The Trainer's builders (the base of ``train.Trainer``; not used alone). The parts a Trainer
    is made of are declared here, each set once: by ``Trainer.__init__`` (the first group) or by
    the builder that makes it."""

    # Set by Trainer.__init__ from its arguments, before any builder runs.
    cfg: JobConfig
    info: dist_utils.DistInfo
    device: torch.device
    run_id: str
    in_step: bool  # whether the loop is inside a step (else in the work after one)
    model_args: Any
    parallel_dims: ParallelDims
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    use_autocast: bool
    spec: TrainSpec
    # _build_model
    model: ModelProtocol
    float8: Float8Converter | None
    float8_precompute: bool
    compiled_units: int
    finish_gradients: Callable[[], None]
    before_micro_batch: Callable[[bool], None]
    params: list[torch.Tensor]
    # _build_training
    num_loops: int
    segments: list[tuple[int, int]]
    depth: DepthSampler | None
    diagnostics: BranchDiagnostics
    optimizer: torch.optim.Optimizer
    lr_scheduler: LambdaLR
    spike_guard: SpikeGuard
    state: TrainState
    divergence: DivergenceMonitor
    data_path: str | Path
    vocab_size: int
    tokenizer_name: str | None
    dataloader: Any
    metrics: MetricsLogger
    flops_per_token: float
    # _build_services
    stop_signals: PreemptionWatcher
    held_out: HeldOutEval
    downstream: Any
    resumed: bool
    resumed_from: int | None
    launch_recorded: bool
    checkpointer: CheckpointManager
    # _build_step
    step: SegmentedStep

    def log(self, msg: str) -> None:
        """A console line from the metrics rank only."""
        if self.info.rank == self.cfg.metrics.log_rank:
            print(f"[torchtitan_loom] {msg}", flush=True)

    def _build_model(self) -> ModelProtocol:
        """meta → (converters) → AC, compile → parallelize → materialise → layout-independent init."""
        cfg, t = self.cfg, self.cfg.training
        with torch.device("meta"):
            module = self.spec.model_cls(self.model_args)
        # One object, two faces: the nn.Module the wrappers and the optimizer take, and the
        # protocol the trainer reads (a TrainSpec's model_cls builds both).
        model = cast(ModelProtocol, module)
        if self.info.rank == cfg.metrics.log_rank:  # within seconds of start, before any allocation
            n_segments = len(training_depth(t, model.num_loops)[0])
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
            self.log(self.float8.convert(module).summary(self.float8.plan))
        # AC and compile where the model declares them (the config check refused anything else).
        self.compiled_units = apply_checkpoint_and_compile(
            module, self.spec, cfg, expert_parallel=self.parallel_dims.ep_enabled
        )
        if self.spec.parallelize_fn is not None:
            module, self.finish_gradients, self.before_micro_batch = self.spec.parallelize_fn(
                module, self.parallel_dims, cfg
            )
            model = cast(ModelProtocol, module)
        else:  # a plain replicated model: every gradient is summed over the ranks
            self.finish_gradients = lambda: dist_utils.reduce_gradients(
                self.params, self.reduce_dtype
            )
            self.before_micro_batch = lambda last: None
        module.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights()
        # Tensorwise float8 scale precompute: only when FSDP sharded the float8 weights.
        self.float8_precompute = self.float8 is not None and self.float8.precompute_applies(module)
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
        self.params = [p for p in module.parameters() if p.requires_grad]
        module.train()
        return model

    def _build_training(self) -> None:
        """Segments, optimizer, schedule, spike guard, train state, divergence, data, metrics."""
        cfg, t, s, model = self.cfg, self.cfg.training, self.cfg.lr_scheduler, self.model
        self.num_loops = model.num_loops
        self.segments, self.depth = training_depth(t, self.num_loops)
        if self.segments[-1][1] > self.num_loops:  # training.sample_depth_max: loops past H
            if not isinstance(model, ExitsPerToken):
                raise ValueError(
                    f"training.sample_depth_max = {t.sample_depth_max}: model "
                    f"{cfg.model.name!r} runs no loop past its H; set it to 0"
                )
            model.set_beyond_policy(BEYOND_POLICY)
        self.diagnostics = build_diagnostics(
            cfg.metrics, model, len(self.segments), self.device, self.segments[-1][1]
        )
        self.optimizer = build_optimizer(cast(nn.Module, model), cfg.optimizer)
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
        # The head runs once per segment, so it counts once per segment (see the model docstring);
        # with depth sampling, the expected loops and segments of a step.
        self.flops_per_token = expected_flops(model, t.seq_len, self.segments, self.depth)
        self._log_layout()

    def _log_layout(self) -> None:
        cfg, t, info, counts = self.cfg, self.cfg.training, self.info, self.model.param_counts()
        self.log(
            f"model {cfg.model.name}/{cfg.model.flavor}: {counts['total']:,} parameters "
            f"({counts['active']:,} active per token), H={self.num_loops}, segments={self.segments}, "
            f"world={info.world_size}, device={self.device}, compute dtype={t.mixed_precision_param}, "
            f"init seed={self.model.args.init_seed} (training.seed), data={self.data_path}"
        )
        if self.depth is not None:
            self.log(
                f"depth sampling ({depth_key(t)}): each step runs "
                f"{self.depth.depths()} loops, drawn uniformly per step "
                f"({self.depth.mean_loops():.2f} on average)"
            )
        elif self.segments[-1][1] > self.num_loops:
            self.log(f"depth past H ({depth_key(t)}): every step runs {self.segments[-1][1]} loops")
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
        common: dict[str, Any] = dict(
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
            log_every=cfg.metrics.log_freq,
        )

    def _build_step(self) -> SegmentedStep:
        """The segmented step over the parts built above (it holds them; the Trainer runs it)."""
        float8, model = self.float8, self.model
        head = model.exit_parameters() if isinstance(model, ExitsPerToken) else []
        # The exit head's gradient stays out of the clip's norm: it must not rescale the LM's.
        lm_params = [p for p in self.params if all(p is not h for h in head)]
        hook = None
        if self.float8_precompute and float8 is not None:
            hook = lambda: float8.post_optimizer_hook(cast(nn.Module, model))  # noqa: E731
        return SegmentedStep(
            StepParts(
                model=model,
                params=lm_params,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                finish_gradients=self.finish_gradients,
                before_micro_batch=self.before_micro_batch,
                spike_guard=self.spike_guard,
                state=self.state,
                segments=self.segments,
                stop_signals=self.stop_signals,
                diagnostics=self.diagnostics,
                micro_batches=self.micro_batches,
                autocast=self.autocast,
                max_norm=self.cfg.training.max_norm,
                dp_degree=self.parallel_dims.dp,
                device=self.device,
                after_optimizer_step=hook,
                depth=self.depth,
                learned_exit=bool(head),
            )
        )

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast without FSDP (a single process included); under FSDP its MixedPrecisionPolicy
        computes with bf16 parameters instead; fp32 runs are plain."""
        if not self.use_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """This rank's rows of a global batch, in micro-batches of training.micro_batch_size, on
        the device."""
        mb = self.cfg.training.micro_batch_size
        rows = batch["input_ids"].shape[0]
        return [
            {k: v[i : i + mb].to(self.device, non_blocking=True) for k, v in batch.items()}
            for i in range(0, rows, mb)
        ]
