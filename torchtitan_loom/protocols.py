"""What the trainer knows about a model: the ModelProtocol, its output type, and the TrainSpec
registry (TorchTitan v0.2.2 spirit: a named spec carries the model class, its flavors and the
parallelize function, plus what the tools around the trainer need to know about the model).

The legend of the whole package (a file that uses a letter otherwise says so in its own legend):
B batch rows, S sequence length, D model dim, V vocab, L layers, H loops of a full forward, T loops of
the range a call runs, E routed experts, K routed top-k. A shape suffix names a tensor's axes in order
(x_BSD is [B, S, D]).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is imported by what uses these types; the config reads this module first
    import torch
    from torch import nn

    from torchtitan_loom.loop_request import DecodeCache, ExitHold, LoopRequest
    from torchtitan_loom.model_cost import ModelCost


def segments(num_loops: int, seg_len: int) -> list[tuple[int, int]]:
    """1-based inclusive loop ranges of the backprop segments; seg_len 0 = one segment."""
    if seg_len <= 0 or seg_len >= num_loops:
        return [(1, num_loops)]
    return [(a, min(a + seg_len - 1, num_loops)) for a in range(1, num_loops + 1, seg_len)]


class ModelOutput(NamedTuple):
    """Result of a forward over loops [loop_start, loop_end]."""

    logits_BSV: torch.Tensor
    """fp32 logits of the head applied to the state after loop_end."""
    carry: Any
    """State after loop_end, opaque to the trainer, NOT detached: handed back as ``carry`` to run the
    next loops, and ``carry.detach()`` at a segment boundary (a tensor qualifies)."""
    aux_loss: torch.Tensor
    """Scalar auxiliary loss added to the step's loss (0 when the model has none)."""
    counts_LTE: torch.Tensor | None = None
    """int64 kept assignments per layer, per loop of the range, per routed expert; None for a model
    without routed experts (``ModelProtocol.routing`` is None)."""
    topk_LTBSK: torch.Tensor | None = None
    """int64 routed expert ids chosen per layer, loop, token; only when the request's return_topk
    is set (eval, analysis) on a routed model, else None so training carries nothing extra."""
    observed_LTNK: torch.Tensor | None = None
    """The request's `observe` function applied to each of the N observed branch outputs (see
    ModelProtocol.observed_branches) of every layer and loop of the range, stacked; None without it."""
    exit_gain_BS: torch.Tensor | None = None
    """fp32 [B, S] predicted drop of each token's loss (nats) over loops loop_start.., from the
    detached carry (ExitsPerToken.exit_gain); None without a head or a carry."""


class HfExport(NamedTuple):
    """What ``tools.export --format hf`` writes of a model besides its weights and tokenizer."""

    modeling_file: str
    """The file name transformers loads the model's code from (``modeling_<type>.py``)."""
    modeling_source: str
    """Its source: standalone, importing nothing from torchtitan_loom."""
    config: dict[str, Any]
    """The model's own config.json fields (architectures, model_type, auto_map, its args)."""


class Routing(NamedTuple):
    """How a model with routed experts reports them (``ModelProtocol.routing``)."""

    num_layers: int
    """L of ``counts_LTE`` / ``topk_LTBSK``."""
    num_experts: int
    """E of ``counts_LTE``."""


@runtime_checkable
class ModelProtocol(Protocol):
    """Everything the trainer uses of a model, and nothing about its internals.

    The package reads no model-specific field: shapes of the step's buffers, FLOPs, the
    activation-checkpoint seam come through this surface; what a model may lack is an optional
    protocol below (UpdatesAfterStep, DecodesIncrementally) or a TrainSpec field that may be None
    (memory terms: cost_fn; the inference cast: inference_fp32_fn). A second model registered in
    tests/unit/test_protocol.py trains, parallelizes, generates, scores and dry-runs through it.
    """

    args: Any
    """The typed model args: a frozen dataclass with ``validate()``, ``init_seed``, ``vocab_size``,
    ``max_seq_len`` and ``num_loops`` (H; the dry run, the estimate and the inference tools read it
    from the args before any model exists); its other fields are the model's own ``[model]`` keys."""
    region_wrappers: dict[str, Callable[..., Any]]
    """The AC seam: scope -> wrapper(fn, *args) that must return fn(*args); empty = plain calls.
    The scopes a model passes are declared in ``TrainSpec.checkpoint_scopes``; names never change."""

    @property
    def num_loops(self) -> int:
        """H, the number of loops of a full forward."""
        ...

    @property
    def routing(self) -> Routing | None:
        """The routed experts' shape, or None for a model without any."""
        ...

    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer in place, layout-independently."""
        ...

    def __call__(
        self,
        tokens_BS: torch.Tensor,
        positions_BS: torch.Tensor,
        doc_ids_BS: torch.Tensor,
        loop_start: int = 1,
        loop_end: int | None = None,
        *,
        carry: Any = None,
        request: LoopRequest | None = None,
    ) -> ModelOutput:
        """Run loops [loop_start, loop_end] (1-based, global); carry is None iff loop_start == 1.
        `request` (loop_request.LoopRequest; None asks for nothing) names the optional modes: the
        expert ids, an observer of the branch outputs, a decode cache, an exit hold (the last two
        only for a model with DecodesIncrementally / ExitsPerToken)."""
        ...

    def observed_branches(self) -> tuple[int, tuple[str, ...]]:
        """(L, names of the N branch outputs) that `observe` sees in each of L layers in every loop
        (LOOM: attention, moe); (0, ()) for a model that observes nothing."""
        ...

    def param_groups(self) -> dict[str, list[str]]:
        """Submodule name -> names of its parameters (per-submodule gradient norms); every group is
        listed even when empty, so the key set does not depend on the layout."""
        ...

    def carry_stream(self, carry: Any) -> torch.Tensor:
        """The [B, S, D] stream held in ``carry`` (the eval's stream cosine between loops reads it)."""
        ...

    def stream_rms(self, carry: Any) -> torch.Tensor:
        """Per-token RMS [B, S] of the stream in ``carry``'s last loop, measured where it can move
        (before any normalisation that closes the loop; the eval's ``stream_rms_loop_t``)."""
        ...

    def param_counts(self) -> dict[str, int]:
        """{"total": all parameters, "active": parameters used per token}."""
        ...

    def flops_per_token(self, seq_len: int, head_calls: int = 1) -> float:
        """Training FLOPs per token over all loops (forward + backward); the head counted `head_calls`
        times (once per backprop segment)."""
        ...


@runtime_checkable
class UpdatesAfterStep(Protocol):
    """Optional: a model that updates its own state from each accepted step's statistics (LOOM: the
    expert-bias sign update). A model without it gets no call and, without ``routing``, no
    collective for its counts."""

    def after_step(self, counts_LE: torch.Tensor) -> None:
        """Once per step that no segment skipped, from ``counts_LTE`` summed over the step's loops,
        micro-batches and data-parallel ranks (the same on every rank)."""
        ...


@runtime_checkable
class DecodesIncrementally(Protocol):
    """Optional: a model whose forward also takes a request's ``cache`` (the sampler's incremental
    decoding). Without it the sampler recomputes the whole sequence for every new token (same
    tokens)."""

    def new_decode_cache(self) -> DecodeCache:
        """An empty cache, the request's ``cache`` of every forward of one generation: the tokens of a
        call continue the cached positions of every row (one document per row, doc_ids ignored).
        Raises ValueError when the model's args cannot decode incrementally."""
        ...


BEYOND_POLICIES = ("last", "cycle")
"""What ``ExitsPerToken.set_beyond_policy`` takes, the default first: which trained router a loop
past the trained depth reuses (LOOM: models/loom/depth.py). The tools check --beyond against these
before any model is loaded."""


@runtime_checkable
class ExitsPerToken(Protocol):
    """Optional: a model that runs loops past its trained depth and lets single tokens stop early
    (the depth report, adaptive decoding). Its forward also takes a request's ``hold`` (the K/V of
    tokens marked exited are held at their exit loop's)."""

    def set_beyond_policy(self, policy: str | None) -> None:
        """Allow loop_end > num_loops under ``policy`` (one of BEYOND_POLICIES); None refuses them
        again."""
        ...

    def new_exit_hold(self, cache: DecodeCache | None = None) -> ExitHold:
        """An empty hold over ``cache`` (a decode cache, or None for a whole-sequence call), with
        ``exit(new_BS)``: the tokens of ``new_BS`` exit after the loop just run."""
        ...

    def exit_parameters(self) -> list[nn.Parameter]:
        """The learned exit head's parameters ([] without one: exit_gain then refuses)."""
        ...

    def exit_gain(self, carry: Any, loop: int) -> torch.Tensor:
        """[B, S] fp32 predicted drop of each token's loss (nats) over the loops after ``loop``
        (the carry's last), from the learned exit head; ValueError without one."""
        ...


class Parallelized(NamedTuple):
    """What a parallelize function hands back to the trainer."""

    model: nn.Module
    finish_gradients: Callable[[], None]
    """Called once per segment after backward: sums over the data-parallel ranks every gradient the
    applied wrappers (FSDP) did not already reduce, so the step need not know which those are."""
    before_micro_batch: Callable[[bool], None] = lambda last: None
    """Called before each micro-batch's forward with last=True for a segment's final one: lets the
    wrappers defer their gradient reduction (and keep parameters gathered) to the segment's end."""


GroupedGemm = Callable[..., Any]  # (x_MD, w_EDF, offsets_E) -> y_MF, tensors
"""(a_PK, b_EKN, ends_E) -> out_PN: group e is rows [ends_E[e-1], ends_E[e]) of a times b[e]."""


class GroupedKernel(NamedTuple):
    """A low-precision grouped GEMM the float8 converter hands to TrainSpec.float8_experts_fn; the
    model decides what it computes with it and on which of its weights."""

    name: str
    """'fp8_rowwise', 'mxfp8' or 'mxfp8_emulated' (in the report and the modules' repr)."""
    alignment: int
    """Rows: every group must start at a multiple of it in the buffer `gemm` sees."""
    dim_multiple: int
    """Both weight dims (reduction and output) must be multiples of it."""
    gemm: GroupedGemm
    pad_rows: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, int]]
    """(counts_E, rows A) -> (dest_A padded row of each row, ends_E int32 group ends, P buffer rows):
    where a model puts its grouped rows so that every group is aligned."""


@dataclass(frozen=True)
class Sharding:
    """How the dry run's parameter report folds the model's repeated units (by parameter name)."""

    repeated_unit: str | None = None
    """Regex matching the name prefix of a repeated unit, its index the first group (e.g. a layer):
    units whose parameters match the first one's are reported once."""
    unit_name: str = "unit"
    """What one repeated unit is called in the report ("layer")."""


@dataclass(frozen=True)
class TrainSpec:
    """A registered model: its class, its named argument sets, how to parallelize it, and what the
    config, the dry run and the float8 converter need to know about it."""

    name: str
    model_cls: type[nn.Module]
    model_args: Mapping[str, Any]
    """flavor name -> model args (a frozen dataclass; its fields are the ``[model]`` config keys)."""
    parallelize_fn: Callable[..., Parallelized] | None = None
    """parallelize(model, parallel_dims, job_config) -> Parallelized: expert parallelism and FSDP2,
    after the trainer applied AC and compile (distributed/model_wrappers.py); None = a plain
    replicated model."""
    checkpoint_scopes: tuple[str, ...] = ()
    """The ``activation_checkpoint.mode`` values the model honours: scopes its forward passes
    through ``region_wrappers``. Another mode is a config error."""
    compile_units_fn: Callable[[nn.Module], list[nn.Module]] | None = None
    """model -> the submodules torch.compile compiles in place (names unchanged; one graph should
    serve every loop). None: ``compile.enable`` is a config error."""
    kernel_report_fn: Callable[..., list[str]] | None = None
    """kernel_report(model, device_type, compute_dtype, compiling) -> log lines naming the kernels the
    model will use on this device (attention backend, GEMM fallbacks); the trainer logs them once."""
    arg_choices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """[model] key -> its valid string values (shown by --help, checked on load)."""
    relaunch_tunable: tuple[str, ...] = ()
    """Args that may change between launches of one run and between save and resume (same math)."""
    config_errors_fn: Callable[..., list[str]] | None = None
    """config_errors(job_config, model_args, parallel_dims | None) -> one line per problem of the model
    with this config (checked before any process group exists)."""
    layout_errors_fn: Callable[[Any, Any], list[str]] | None = None
    """layout_errors(model_args, parallel_dims) -> one line per rule of the model that this layout
    breaks (the config check and every layout the dry run's estimate ranks)."""
    num_experts_fn: Callable[[Any], int | None] | None = None
    """model args -> routed experts to split over the ep mesh (None: the model cannot use ep)."""
    sharding: Sharding = Sharding()
    float8_never_convert: tuple[str, ...] = ()
    """Module-name segments the float8 converter never converts (e.g. embedding, head, routers)."""
    float8_experts_fn: (
        Callable[[nn.Module, GroupedKernel, tuple[str, ...]], tuple[list[str], dict[str, str]]]
        | None
    ) = None
    """float8_experts(model, kernel, filter_fqns) -> (names converted, {name skipped: why}): swaps
    the model's routed experts, in place on the meta model, for modules that compute with `kernel`
    (same parameter names); `filter_fqns` names modules to keep. None: the model has no experts."""
    inference_fp32_fn: Callable[[str], bool] | None = None
    """tensor name -> True when it stays fp32 while the inference tools cast the model (lm_eval
    --param-dtype, export --dtype); None: every floating tensor casts."""
    portable_args_fn: Callable[[Any, bool], Any] | None = None
    """portable_args(args, decoding) -> the args the inference tools run a trained model with: kernels
    that run on any device, the training math unchanged; ``decoding`` also makes each token's result
    independent of the rest of the batch (incremental decoding). None: the args as trained."""

    hf_export_fn: Callable[[Any], HfExport] | None = None
    """hf_export(model_args) -> the Hugging Face modeling file and config fields (tools.export
    --format hf); None: the model has no HF export, and the tool says so in one line."""

    cost_fn: Callable[..., ModelCost] | None = None
    """cost(model_args, parallel_dims, job_config) -> ModelCost: FSDP units, FLOPs and activation
    bytes per segment, read by the dry run's estimate (None: the dry run prints no estimate)."""


def cast_for_inference(
    spec: TrainSpec, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``tensors`` (a state dict, or a model's named parameters and buffers) with every floating one
    in ``dtype`` except those ``spec.inference_fp32_fn`` keeps in fp32."""
    import torch

    keep = spec.inference_fp32_fn or (lambda name: False)
    return {
        name: t.to(dtype) if torch.is_floating_point(t) and not keep(name) else t
        for name, t in tensors.items()
    }


def cast_model_for_inference(spec: TrainSpec, model: nn.Module, dtype: torch.dtype) -> None:
    """``cast_for_inference`` applied in place to ``model``'s parameters and buffers."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for name, cast in cast_for_inference(spec, tensors, dtype).items():
        tensors[name].data = cast


def portable_args(spec: TrainSpec, args: Any, decoding: bool) -> Any:
    """``spec.portable_args_fn(args, decoding)``, or ``args`` when the spec has none."""
    return args if spec.portable_args_fn is None else spec.portable_args_fn(args, decoding)


# The registry is the only module-level mutable state in the package: specs register once at
# import of their model package and are read-only afterwards.
_REGISTRY: dict[str, TrainSpec] = {}

_MODELS_PACKAGE = "torchtitan_loom.models"


def register_train_spec(name: str, spec: TrainSpec) -> None:
    """Register `spec` under `name`; registering a different spec under a taken name is an error."""
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not spec:
        raise ValueError(f"train spec {name!r} is already registered")
    _REGISTRY[name] = spec


def get_train_spec(name: str) -> TrainSpec:
    """The spec registered as `name`; imports the bundled model packages on first use."""
    if name not in _REGISTRY:
        bundled = importlib.import_module(_MODELS_PACKAGE).BUNDLED
        if name in bundled:
            importlib.import_module(bundled[name][1])  # registers it
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown train spec {name!r}; registered: {', '.join(sorted(_known())) or 'none'}"
        )
    return _REGISTRY[name]


def relaunch_tunable_of(name: str) -> tuple[str, ...]:
    """The spec `name`'s relaunch_tunable without importing its model: a registered spec's own, or
    a bundled model's ``args`` module's RELAUNCH_TUNABLE (torch-free, like model_args_of)."""
    if name in _REGISTRY:
        return _REGISTRY[name].relaunch_tunable
    bundled = importlib.import_module(_MODELS_PACKAGE).BUNDLED
    if name in bundled:
        return tuple(getattr(importlib.import_module(bundled[name][0]), "RELAUNCH_TUNABLE", ()))
    return get_train_spec(name).relaunch_tunable  # raises naming the registered specs


def model_args_of(name: str) -> tuple[Mapping[str, Any], Mapping[str, tuple[str, ...]]]:
    """(flavors, arg_choices) of the spec `name` without importing its model: a registered spec's
    own, or a bundled model's ``args`` module (torch-free), so the config can check its [model]
    keys before torch is imported."""
    if name in _REGISTRY:
        return _REGISTRY[name].model_args, _REGISTRY[name].arg_choices
    bundled = importlib.import_module(_MODELS_PACKAGE).BUNDLED
    if name in bundled:
        args = importlib.import_module(bundled[name][0])
        return args.FLAVORS, args.FIELD_CHOICES
    raise ValueError(
        f"unknown train spec {name!r}; registered: {', '.join(sorted(_known())) or 'none'}"
    )


def _known() -> set[str]:
    return set(_REGISTRY) | set(importlib.import_module(_MODELS_PACKAGE).BUNDLED)
