"""The model protocol is real: a second, non-LOOM model (a looped dense toy, its carry a plain tensor,
no routed experts, no decode cache, no after-step update) registers a TrainSpec with its own FSDP
parallelize function and trains, evaluates, checkpoints, resumes on 2 FSDP ranks, generates, is
scored by the lm-eval adapter and dry-runs through the unchanged package: it implements only what it
has (no LOOM hook stubbed).

Legend: B rows, S sequence length, D width, V vocab, T loops of a call.
"""

import dataclasses
import datetime
import json
import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from tests.rank_exit import run_then_exit
from torchtitan_loom.components.evaluation.sampling import SamplingConfig, generate
from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed import utils as dist_utils
from torchtitan_loom.distributed.utils import DTYPES, DistInfo, reduce_gradients
from torchtitan_loom.protocols import (
    DecodesIncrementally,
    ModelOutput,
    ModelProtocol,
    Parallelized,
    TrainSpec,
    UpdatesAfterStep,
    register_train_spec,
)
from torchtitan_loom.train import main
from torchtitan_loom.trainer import Trainer

CPU = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))


@dataclass(frozen=True, kw_only=True)
class ToyArgs:
    vocab_size: int = 512
    dim: int = 32
    num_loops: int = 3
    max_seq_len: int = 64
    init_seed: int = 0

    def validate(self) -> None:
        if self.num_loops < 1:
            raise ValueError("ToyArgs.num_loops must be >= 1")


class ToyMLP(nn.Module):
    """Its own forward (dynamo skips torch's container modules when one is compiled alone)."""

    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x_BSD)))


class LoopedDenseToy(nn.Module):
    """z <- z + MLP(z), H times, then a head; no experts, no routing bias."""

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.mlp = ToyMLP(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.region_wrappers = {}

    @property
    def num_loops(self) -> int:
        return self.args.num_loops

    def init_weights(self) -> None:
        gen = torch.Generator().manual_seed(self.args.init_seed)
        for p in self.parameters():
            full = torch.randn(p.shape, generator=gen) * 0.05  # the full tensor on every layout
            if isinstance(p, DTensor):  # this rank's shard of it (FSDP)
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)

    def forward(
        self,
        tokens_BS,
        positions_BS,
        doc_ids_BS,
        loop_start=1,
        loop_end=None,
        *,
        carry=None,
        request=None,
    ):
        loop_end = self.num_loops if loop_end is None else loop_end
        z_BSD = self.embed(tokens_BS) if carry is None else carry  # the carry is the stream itself
        for _ in range(loop_start, loop_end + 1):  # each loop one "loop" scope of the AC seam
            z_BSD = self._region("loop", self._loop, z_BSD)
        return ModelOutput(self.head(z_BSD).float(), z_BSD, torch.zeros(()))

    def _loop(self, z_BSD: torch.Tensor) -> torch.Tensor:
        return z_BSD + self.mlp(z_BSD)

    def _region(self, scope, fn, *args):
        wrapper = self.region_wrappers.get(scope)
        return fn(*args) if wrapper is None else wrapper(fn, *args)

    routing = None  # no routed experts: no counts, no routing statistics

    def carry_stream(self, carry: torch.Tensor) -> torch.Tensor:
        return carry

    def stream_rms(self, carry: torch.Tensor) -> torch.Tensor:
        return carry.float().pow(2).mean(-1).sqrt()  # no closing norm: the stream itself

    def observed_branches(self) -> tuple[int, tuple[str, ...]]:
        return 0, ()

    def param_groups(self) -> dict[str, list[str]]:
        return {"all": [name for name, _ in self.named_parameters()]}

    def param_counts(self) -> dict[str, int]:
        total = sum(p.numel() for p in self.parameters())
        return {"total": total, "active": total}

    def flops_per_token(self, seq_len: int, head_calls: int = 1) -> float:
        mlp = sum(p.numel() for p in self.mlp.parameters())
        return 6.0 * (mlp * self.num_loops + self.head.weight.numel() * head_calls)


def parallelize_toy(model: LoopedDenseToy, dims, cfg) -> Parallelized:
    """FSDP2 over the dp_shard ranks: the MLP and the root as units, gradients summed (the trainer's
    loss is already a global token mean); a plain replicated model otherwise."""
    reduce_dtype = DTYPES[cfg.training.mixed_precision_reduce]
    if not dims.fsdp_enabled:
        return Parallelized(model, lambda: reduce_gradients(list(model.parameters()), reduce_dtype))
    mp_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.training.mixed_precision_param], reduce_dtype=reduce_dtype
    )
    mesh = dims.get_mesh("fsdp")
    fully_shard(model.mlp, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return Parallelized(model, lambda: None)  # FSDP reduced every gradient


TOY_SPEC = TrainSpec(
    name="toy_looped",
    model_cls=LoopedDenseToy,
    model_args={"tiny": ToyArgs()},
    parallelize_fn=parallelize_toy,
    checkpoint_scopes=("loop",),
    compile_units_fn=lambda model: [model.mlp],
)


def toy_argv(pack, dump, *extra, steps=8):
    return [
        "--model.name",
        "toy_looped",
        "--model.flavor",
        "tiny",
        "--data.path",
        str(pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.steps",
        str(steps),
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--training.mixed_precision_param",
        "float32",
        "--training.bp_segment_len",
        "1",
        "--metrics.log_freq",
        "1",
        "--eval.interval",
        "8",
        "--eval.tokens",
        "500",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "4",
        "--spike_guard.enable",
        "false",
        "--training.seed",
        "7",
        *extra,
    ]


def losses_of(dump):
    rows = [json.loads(line) for line in open(dump / "metrics.jsonl")]
    return rows, {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_a_second_model_trains_through_the_same_trainer(tiny_pack, tmp_path):
    register_train_spec("toy_looped", TOY_SPEC)
    dump = tmp_path / "run"
    cfg = load_config(toy_argv(tiny_pack, dump))
    trainer = Trainer(cfg, resolve(cfg, 1), CPU)
    assert isinstance(trainer.model, ModelProtocol)
    assert trainer.model.args.init_seed == 7  # training.seed reaches the model args
    assert trainer.train() == 0
    rows, losses = losses_of(dump)
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses.values())
    assert losses[8] < losses[1]
    assert {"eval_loss_loop_1", "eval_loss_loop_2", "eval_loss_loop_3"} <= rows[-1].keys()
    assert not any(
        k.startswith("routing_") for k in rows[-1]
    )  # no routed experts, no routing statistics
    # Only what it has: no after-step update, no decode cache, and nothing stubbed for either.
    assert not isinstance(trainer.model, (UpdatesAfterStep, DecodesIncrementally))
    assert (dump / "checkpoint" / "step-8").is_dir()


def test_the_toy_trains_with_the_ac_and_compile_it_declares(tiny_pack, tmp_path, capsys):
    """AC and compile reach a second family through its spec's declarations (the trainer applies
    them, not LOOM's parallelize): the loop scope holds the checkpoint wrapper, the MLP is compiled
    (dynamo made a graph of it), and the losses are the plain run's. aot_eager traces the same aten
    ops and recompute replays them, so the only difference allowed is float32 reassociation inside
    AOT autograd's decompositions: 1e-6 relative, far below the 1e-2 a lost gradient would move
    the loss by step 4."""
    register_train_spec("toy_looped", TOY_SPEC)
    plain = load_config(toy_argv(tiny_pack, tmp_path / "plain", steps=4))
    assert Trainer(plain, resolve(plain, 1), CPU).train() == 0
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    extra = ("--activation_checkpoint.mode", "loop", "--compile.enable", "true")
    argv = toy_argv(
        tiny_pack, tmp_path / "wrapped", *extra, "--compile.backend", "aot_eager", steps=4
    )
    cfg = load_config(argv)
    trainer = Trainer(cfg, resolve(cfg, 1), CPU)
    assert set(trainer.model.region_wrappers) == {"loop"}
    assert trainer.train() == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the MLP was compiled
    assert "compiling 1 module (first step) ..." in capsys.readouterr().out
    _, want = losses_of(tmp_path / "plain")
    _, got = losses_of(tmp_path / "wrapped")
    assert got.keys() == want.keys() == {1, 2, 3, 4}
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step
    torch._dynamo.reset()


def test_ac_or_compile_a_model_does_not_declare_is_refused(tiny_pack, tmp_path, capsys):
    bare = dataclasses.replace(
        TOY_SPEC, name="toy_bare", checkpoint_scopes=(), compile_units_fn=None
    )
    register_train_spec("toy_bare", bare)

    def argv(*extra):
        return [*toy_argv(tiny_pack, tmp_path / "run", *extra), "--model.name", "toy_bare"]

    assert main(argv("--activation_checkpoint.mode", "block")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "config error: activation_checkpoint.mode = 'block': model 'toy_bare' declares no such "
        "checkpoint scope (TrainSpec.checkpoint_scopes); valid for it: none"
    )
    assert main(argv("--compile.enable", "true")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "config error: compile.enable = true: model 'toy_bare' declares nothing to compile "
        "(TrainSpec.compile_units_fn); set compile.enable = false"
    )
    # The toy declares only its loop scope: another scope of the trainer's vocabulary is refused.
    register_train_spec("toy_looped", TOY_SPEC)
    assert (
        main(toy_argv(tiny_pack, tmp_path / "run2", "--activation_checkpoint.mode", "segment")) == 2
    )
    assert "valid for it: none, loop" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "run2").exists()


def test_model_keys_are_the_chosen_models(tiny_pack, tmp_path, capsys):
    register_train_spec("toy_looped", TOY_SPEC)
    cfg = load_config(toy_argv(tiny_pack, tmp_path, "--model.dim", "16"))
    assert resolve(cfg, 1).model_args.dim == 16  # the toy's own key
    with pytest.raises(ConfigError, match=r"^model.n_heads: not a key of model 'toy_looped'"):
        load_config(
            toy_argv(tiny_pack, tmp_path, "--model.n_heads", "2")
        )  # a LOOM key, not the toy's
    assert main(toy_argv(tiny_pack, tmp_path / "bad", "--model.n_heads", "2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "config error: model.n_heads: not a key of model 'toy_looped'"
    )


def test_the_toy_dry_runs(tiny_pack, tmp_path, capsys):
    register_train_spec("toy_looped", TOY_SPEC)
    argv = toy_argv(
        tiny_pack, tmp_path, "--parallelism.dry_run", "--parallelism.dry_run_world_size", "2"
    )
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dry run: toy_looped/tiny, H=3" in out and "rank 0 parameters" in out
    # Laid out by the toy's own parallelize function over a fake 2-rank group.
    assert "  head.weight  (512, 32) -> (256, 32)  S(0)" in out, out


def _resume_rank(rank: int, world: int, store: str, pack: str, dump: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    register_train_spec("toy_looped", TOY_SPEC)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        cfg = load_config(toy_argv(pack, dump))
        trainer = Trainer(
            cfg,
            resolve(cfg, world),
            DistInfo(rank=rank, world_size=world, device=torch.device("cpu")),
        )
        assert isinstance(trainer.model, FSDPModule)  # through the toy's own parallelize
        # The step's small all-reduces, recorded by dtype: the int64 one is the routing counts', which
        # a model without routed experts never pays (no collective, no after-step call).
        reduced = []
        real_all_reduce = dist_utils.all_reduce
        dist_utils.all_reduce = lambda t, *a, **k: (
            reduced.append(t.dtype) or real_all_reduce(t, *a, **k)
        )
        try:
            assert trainer.train() == 0 and trainer.resumed_from == 4 and trainer.state.step == 8
        finally:
            dist_utils.all_reduce = real_all_reduce
        assert reduced and torch.int64 not in reduced, reduced  # int64: the routing counts
    finally:
        dist.destroy_process_group()


def test_the_toy_resumes_at_another_world_size(tiny_pack, tmp_path):
    """4 steps on one process, the last 4 on two FSDP ranks: the same losses as 8 steps on one."""
    register_train_spec("toy_looped", TOY_SPEC)
    straight, split = tmp_path / "straight", tmp_path / "split"
    cfg = load_config(toy_argv(tiny_pack, straight))
    assert Trainer(cfg, resolve(cfg, 1), CPU).train() == 0
    first = load_config(toy_argv(tiny_pack, split, "--checkpoint.exit_after_step", "4"))
    assert Trainer(first, resolve(first, 1), CPU).train() == 0
    world = 2
    mp.start_processes(
        run_then_exit,
        args=(_resume_rank, world, str(tmp_path / "store"), str(tiny_pack), str(split)),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    _, want = losses_of(straight)
    _, got = losses_of(split)
    assert sorted(got) == list(range(1, 9))
    # Two ranks sum the same token-mean gradient in another order: float32 rounding only.
    for step in range(1, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step


def _toy(seed: int = 3) -> LoopedDenseToy:
    model = LoopedDenseToy(ToyArgs(init_seed=seed))
    with torch.no_grad():
        model.init_weights()
    return model.eval()


def test_the_toy_generates_without_a_decode_cache():
    # No cache: the sampler recomputes the sequence per token; greedy must pick, at every step, the
    # argmax of a full forward over the prompt and the tokens chosen so far.
    model = _toy()
    prompt_BS = torch.tensor([[5, 9, 2], [7, 7, 1]])
    new_BS = generate(model, prompt_BS, SamplingConfig(max_new_tokens=6, temperature=0))
    assert new_BS.shape == (2, 6)
    seq_BS = prompt_BS
    with torch.no_grad():
        for i in range(6):
            positions_BS = torch.arange(seq_BS.shape[1]).expand_as(seq_BS)
            logits_BSV = model(seq_BS, positions_BS, torch.zeros_like(seq_BS)).logits_BSV
            want_B = logits_BSV[:, -1].argmax(-1)
            assert torch.equal(new_BS[:, i], want_B), i
            seq_BS = torch.cat([seq_BS, want_B[:, None]], dim=1)


def test_the_lm_eval_adapter_scores_the_toy():
    pytest.importorskip("lm_eval")
    from types import SimpleNamespace

    from torchtitan_loom.components.data.tokenizer import ByteTokenizer
    from torchtitan_loom.components.evaluation.lm_eval_adapter import LoomLM

    model, tok = _toy(), ByteTokenizer()
    lm = LoomLM(model, tok, torch.device("cpu"), loops=2, batch_size=2)
    (ll, greedy), (ll_b, _) = lm.loglikelihood(
        [SimpleNamespace(args=("ab", "cd")), SimpleNamespace(args=("xyz", "w"))]
    )
    ids = tok.encode("abcd")
    x_BS = torch.tensor([ids[:-1]])
    with torch.no_grad():
        logits_SV = model(
            x_BS, torch.arange(3)[None], torch.zeros_like(x_BS), loop_end=2
        ).logits_BSV[0]
    logp_SV = torch.log_softmax(logits_SV, dim=-1)
    want = logp_SV[1, ids[2]] + logp_SV[2, ids[3]]  # log p(c | ab) + log p(d | abc), loops 1-2
    assert ll == pytest.approx(want.item(), rel=1e-5)
    assert greedy == bool(
        (logp_SV[1:].argmax(-1) == torch.tensor(ids[2:])).all()
    ) and math.isfinite(ll_b)
