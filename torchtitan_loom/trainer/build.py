"""What the Trainer builds, in TorchTitan's order, each builder a function that takes what it reads
and returns the typed part it makes (parts.py): the setting (seeds, meshes, dtypes), the model
(meta → converters → AC, compile → parallelize → materialise → init), what training needs
(segments, optimizer, schedule, guards, data, metrics), the services around it (stop signals,
evals, checkpoints) and the step (step.py) over all of them. ``build`` calls them in turn; the
Trainer (loop.py) owns what it returns. The model is reached only through ``protocols.ModelProtocol``.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from torchtitan_loom.components.checkpoint import CheckpointManager
from torchtitan_loom.components.data import build_train_loader, bundled_corpus_path
from torchtitan_loom.components.evaluation.downstream import build_scorer
from torchtitan_loom.components.evaluation.held_out import HeldOutEval
from torchtitan_loom.components.observability.diagnostics import build_diagnostics
from torchtitan_loom.components.observability.metrics import MetricsLogger
from torchtitan_loom.components.observability.progress import start_report
from torchtitan_loom.components.optim.divergence import DivergenceMonitor
from torchtitan_loom.components.optim.lr_scheduler import build_lr_scheduler
from torchtitan_loom.components.optim.optimizer import build_optimizer
from torchtitan_loom.components.optim.spike_guard import SpikeGuard
from torchtitan_loom.components.quantization.float8 import build_float8_converter
from torchtitan_loom.components.runtime.preemption import PreemptionWatcher
from torchtitan_loom.components.runtime.train_state import TrainState
from torchtitan_loom.config import JobConfig, to_toml
from torchtitan_loom.config.validate import Resolved
from torchtitan_loom.depth_sampling import BEYOND_POLICY, depth_key, training_depth
from torchtitan_loom.depth_sampling import flops_per_token as expected_flops
from torchtitan_loom.distributed import utils as dist_utils
from torchtitan_loom.distributed.model_wrappers import apply_checkpoint_and_compile
from torchtitan_loom.protocols import ExitsPerToken, ModelProtocol, get_train_spec
from torchtitan_loom.trainer.parts import (
    ModelParts,
    Services,
    Setting,
    TrainerParts,
    TrainingParts,
)
from torchtitan_loom.trainer.step import SegmentedStep, StepParts


def build(
    cfg: JobConfig, resolved: Resolved, info: dist_utils.DistInfo, run_id: str
) -> TrainerParts:
    """Everything one launch trains with, in TorchTitan's order; the checkpoint is not loaded
    (``Trainer.resume`` does, as TorchTitan's ``train`` does)."""
    setting = prepare(cfg, resolved, info, run_id)
    model_parts = build_model(setting)
    training = build_training(setting, model_parts.model)
    # Built last, once everything they watch or save exists.
    services = build_services(setting, model_parts.model, training)
    step = build_step(setting, model_parts, training, services)
    return TrainerParts(setting, model_parts, training, services, step)


def prepare(cfg: JobConfig, resolved: Resolved, info: dist_utils.DistInfo, run_id: str) -> Setting:
    """Seeds, the device meshes and the dtypes: what every later builder reads."""
    model_args, parallel_dims = resolved
    t = cfg.training
    dist_utils.set_determinism(t.seed, t.deterministic)
    compute_dtype = dist_utils.DTYPES[t.mixed_precision_param]
    # Meshes first: resolve() checked every degree (ParallelDims) before any process group existed.
    parallel_dims.build_meshes(info.device.type)
    return Setting(
        cfg=cfg,
        info=info,
        run_id=run_id,
        model_args=model_args,
        parallel_dims=parallel_dims,
        spec=get_train_spec(cfg.model.name),
        compute_dtype=compute_dtype,
        reduce_dtype=dist_utils.DTYPES[t.mixed_precision_reduce],
        # FSDP's MixedPrecisionPolicy casts the parameters; autocast would only add casts on top.
        use_autocast=compute_dtype != torch.float32 and not parallel_dims.fsdp_enabled,
    )


def build_model(s: Setting) -> ModelParts:
    """meta → (converters) → AC, compile → parallelize → materialise → layout-independent init."""
    cfg, t, spec = s.cfg, s.cfg.training, s.spec
    with torch.device("meta"):
        module = spec.model_cls(s.model_args)
    # One object, two faces: the nn.Module the wrappers and the optimizer take, and the
    # protocol the trainer reads (a TrainSpec's model_cls builds both).
    model = cast(ModelProtocol, module)
    _start_report(s, model)
    float8 = build_float8_converter(  # None unless float8.enable
        cfg.float8, t.device, spec, t.micro_batch_size * t.seq_len
    )
    if float8 is not None:
        s.log(float8.convert(module).summary(float8.plan))
    # AC and compile where the model declares them (the config check refused anything else).
    compiled_units = apply_checkpoint_and_compile(
        module, spec, cfg, expert_parallel=s.parallel_dims.ep_enabled
    )
    hooks = None
    if spec.parallelize_fn is not None:
        module, finish, before = spec.parallelize_fn(module, s.parallel_dims, cfg)
        model, hooks = cast(ModelProtocol, module), (finish, before)
    module.to_empty(device=s.device)
    with torch.no_grad():
        model.init_weights()
    # Tensorwise float8 scale precompute: only when FSDP sharded the float8 weights.
    float8_precompute = float8 is not None and float8.precompute_applies(module)
    if float8_precompute:
        s.log(
            "float8: FSDP shards the float8 weights; their scales are precomputed after each "
            "optimizer step"
        )
    if spec.kernel_report_fn is not None:  # which kernels the model picked, said once
        for line in spec.kernel_report_fn(
            model, s.device.type, s.compute_dtype, cfg.compile.enable
        ):
            s.log(line)
    params: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
    module.train()
    if hooks is None:  # a plain replicated model: every gradient is summed over the ranks
        hooks = (lambda: dist_utils.reduce_gradients(params, s.reduce_dtype), lambda last: None)
    return ModelParts(model, params, float8, float8_precompute, compiled_units, *hooks)


def _start_report(s: Setting, model: ModelProtocol) -> None:
    """The model and layout at a glance, within seconds of start, before any allocation."""
    if s.info.rank != s.cfg.metrics.log_rank:
        return
    n_segments = len(training_depth(s.cfg.training, model.num_loops)[0])
    for line in start_report(
        s.cfg,
        s.parallel_dims,
        model,
        n_segments,
        s.device,
        s.compute_dtype,
        cost_fn=s.spec.cost_fn,
    ):
        s.log(line)


def build_training(s: Setting, model: ModelProtocol) -> TrainingParts:
    """Segments, optimizer, schedule, spike guard, train state, divergence, data, metrics."""
    cfg, t, sched, g = s.cfg, s.cfg.training, s.cfg.lr_scheduler, s.cfg.spike_guard
    loops, depth = training_depth(t, model.num_loops)
    if loops[-1][1] > model.num_loops:  # training.sample_depth_max: loops past H
        if not isinstance(model, ExitsPerToken):
            raise ValueError(
                f"training.sample_depth_max = {t.sample_depth_max}: model "
                f"{cfg.model.name!r} runs no loop past its H; set it to 0"
            )
        model.set_beyond_policy(BEYOND_POLICY)
    optimizer = build_optimizer(cast(nn.Module, model), cfg.optimizer)
    state = TrainState()
    data_path = cfg.data.path or bundled_corpus_path(cfg.data.cache_dir or None, log=s.log)
    tokenizer_name = cfg.data.tokenizer or None  # checked against the pack's own record
    training = TrainingParts(
        segments=loops,
        depth=depth,
        diagnostics=build_diagnostics(cfg.metrics, model, len(loops), s.device, loops[-1][1]),
        optimizer=optimizer,
        lr_scheduler=build_lr_scheduler(
            optimizer,
            total_steps=t.steps,
            warmup_ratio=sched.warmup_ratio,
            decay_ratio=sched.decay_ratio,
            min_ratio=sched.min_ratio,
            kind=sched.kind,
        ),
        spike_guard=SpikeGuard(g),
        state=state,
        divergence=DivergenceMonitor(g.abort_on_spike, g.max_consecutive_skips, state),
        data_path=data_path,
        tokenizer_name=tokenizer_name,
        dataloader=build_train_loader(
            data_path,
            seq_len=t.seq_len,
            vocab_size=model.args.vocab_size,
            global_batch_rows=t.global_batch_size,
            dp_rank=s.info.rank,
            dp_world=s.parallel_dims.dp,
            tokenizer_name=tokenizer_name,
        ),
        metrics=MetricsLogger(
            cfg.job.dump_folder,
            cfg.metrics,
            rank=s.info.rank,
            run_id=s.run_id,
            wandb_config=cfg.to_dict(),
        ),
        # The head runs once per segment, so it counts once per segment (see the model
        # docstring); with depth sampling, the expected loops and segments of a step.
        flops_per_token=expected_flops(model, t.seq_len, loops, depth),
    )
    _log_layout(s, model, training)
    return training


def _log_layout(s: Setting, model: ModelProtocol, training: TrainingParts) -> None:
    cfg, t, info, counts = s.cfg, s.cfg.training, s.info, model.param_counts()
    s.log(
        f"model {cfg.model.name}/{cfg.model.flavor}: {counts['total']:,} parameters "
        f"({counts['active']:,} active per token), H={model.num_loops}, "
        f"segments={training.segments}, world={info.world_size}, device={s.device}, "
        f"compute dtype={t.mixed_precision_param}, init seed={model.args.init_seed} "
        f"(training.seed), data={training.data_path}"
    )
    depth = training.depth
    if depth is not None:
        s.log(
            f"depth sampling ({depth_key(t)}): each step runs "
            f"{depth.depths()} loops, drawn uniformly per step "
            f"({depth.mean_loops():.2f} on average)"
        )
    elif training.segments[-1][1] > model.num_loops:
        s.log(f"depth past H ({depth_key(t)}): every step runs {training.segments[-1][1]} loops")
    if info.world_size > 1:
        s.log(
            "parallelism: "
            + "; ".join(line.strip() for line in s.parallel_dims.describe().splitlines())
            + f"; activation_checkpoint={cfg.activation_checkpoint.mode}, "
            f"compile={cfg.compile.enable}"
        )


def build_services(s: Setting, model: ModelProtocol, training: TrainingParts) -> Services:
    """Stop signals, the held-out and downstream evals, the checkpoint manager."""
    cfg, ck, t, info = s.cfg, s.cfg.checkpoint, s.cfg.training, s.info
    stop_signals = PreemptionWatcher(
        ck.enable and ck.save_on_signal,
        s.device,
        exit_after_step=ck.exit_after_step if ck.enable else 0,
    )
    common = dict(
        model=model,
        data_path=training.data_path,
        tokenizer_name=training.tokenizer_name,
        vocab_size=model.args.vocab_size,
        device=s.device,
        autocast=s.autocast,
        stop_requested=stop_signals.requested,
        log=s.log,
    )
    held_out = HeldOutEval(
        cfg.eval,
        val_path=cfg.data.val_path or None,
        seq_len=t.seq_len,
        batch_rows=t.global_batch_size,
        dp_rank=info.rank,
        dp_world=s.parallel_dims.dp,
        micro_batches=s.micro_batches,
        **common,
    )
    downstream = build_scorer(cfg.eval, **common)
    states = {"lr_scheduler": training.lr_scheduler, "dataloader": training.dataloader}
    states.update(spike_guard=training.spike_guard, train_state=training.state)
    checkpointer = CheckpointManager(
        ck,
        dump_folder=cfg.job.dump_folder,
        model=model,
        optimizer=training.optimizer,
        states=states,
        model_args=s.model_args,
        model_name=cfg.model.name,
        flavor=cfg.model.flavor,
        config_toml=to_toml(cfg),
        total_steps=t.steps,
        device=s.device,
        rank=info.rank,
        world_size=info.world_size,
        log=s.log,
        log_every=cfg.metrics.log_freq,
    )
    return Services(stop_signals, held_out, downstream, checkpointer)


def build_step(
    s: Setting, model_parts: ModelParts, training: TrainingParts, services: Services
) -> SegmentedStep:
    """The segmented step over the parts built before it (it holds them; the Trainer runs it)."""
    float8, model = model_parts.float8, model_parts.model
    head = model.exit_parameters() if isinstance(model, ExitsPerToken) else []
    # The exit head's gradient stays out of the clip's norm: it must not rescale the LM's.
    # Without a head the step shares the model parts' own list (one of each part, shared).
    lm_params = (
        [p for p in model_parts.params if all(p is not h for h in head)]
        if head
        else model_parts.params
    )
    hook = None
    if model_parts.float8_precompute and float8 is not None:
        hook = lambda: float8.post_optimizer_hook(cast(nn.Module, model))  # noqa: E731
    return SegmentedStep(
        StepParts(
            model=model,
            params=lm_params,
            optimizer=training.optimizer,
            lr_scheduler=training.lr_scheduler,
            finish_gradients=model_parts.finish_gradients,
            before_micro_batch=model_parts.before_micro_batch,
            spike_guard=training.spike_guard,
            state=training.state,
            segments=training.segments,
            stop_signals=services.stop_signals,
            diagnostics=training.diagnostics,
            micro_batches=s.micro_batches,
            autocast=s.autocast,
            max_norm=s.cfg.training.max_norm,
            dp_degree=s.parallel_dims.dp,
            device=s.device,
            after_optimizer_step=hook,
            depth=training.depth,
            learned_exit=bool(head),
        )
    )
