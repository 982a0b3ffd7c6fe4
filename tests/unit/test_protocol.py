"""The model protocol is real: a second, non-LOOM model (a looped dense toy) registers a TrainSpec and
trains, evaluates and checkpoints through the unchanged trainer.

Legend: B rows, S sequence length, D width, V vocab, T loops of a call.
"""

import json
import math
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.protocols import LoopCarry, ModelOutput, ModelProtocol, TrainSpec, register_train_spec
from torchtitan_loom.train import Trainer

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


class LoopedDenseToy(nn.Module):
    """z <- z + MLP(z), H times, then a head; no experts, no routing bias."""

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.mlp = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(), nn.Linear(4 * args.dim, args.dim))
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.region_wrappers = {}
        self.bias_updates = 0

    @property
    def num_loops(self) -> int:
        return self.args.num_loops

    def init_weights(self) -> None:
        gen = torch.Generator().manual_seed(self.args.init_seed)
        for p in self.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)

    def forward(self, tokens_BS, positions_BS, doc_ids_BS, loop_start=1, loop_end=None, carry=None,
                return_topk=False, observe=None):
        loop_end = self.num_loops if loop_end is None else loop_end
        z_BSD = self.embed(tokens_BS) if carry is None else carry.z_BSD
        for _ in range(loop_start, loop_end + 1):
            z_BSD = z_BSD + self.mlp(z_BSD)
        zeros_BSD = torch.zeros_like(z_BSD)
        counts_LTE = torch.zeros(0, loop_end - loop_start + 1, 0, dtype=torch.int64)
        return ModelOutput(self.head(z_BSD).float(), LoopCarry(z_BSD, zeros_BSD, zeros_BSD[..., :1]),
                           counts_LTE, torch.zeros(()))

    def expert_counts_shape(self) -> tuple[int, int]:
        return 0, 0

    def observation_layout(self) -> tuple[int, tuple[str, ...]]:
        return 0, ()

    def param_groups(self) -> dict[str, list[str]]:
        return {"all": [name for name, _ in self.named_parameters()]}

    def update_expert_bias(self, counts_LE: torch.Tensor) -> None:
        assert counts_LE.shape == (0, 0)
        self.bias_updates += 1

    def param_counts(self) -> dict[str, int]:
        total = sum(p.numel() for p in self.parameters())
        return {"total": total, "active": total}

    def flops_per_token(self, seq_len: int, head_calls: int = 1) -> float:
        mlp = sum(p.numel() for p in self.mlp.parameters())
        return 6.0 * (mlp * self.num_loops + self.head.weight.numel() * head_calls)


TOY_SPEC = TrainSpec(name="toy_looped", model_cls=LoopedDenseToy, model_args={"tiny": ToyArgs()})


def test_a_second_model_trains_through_the_same_trainer(tiny_pack, tmp_path):
    register_train_spec("toy_looped", TOY_SPEC)
    dump = tmp_path / "run"
    cfg = load_config(["--model.name", "toy_looped", "--model.flavor", "tiny", "--data.path", str(tiny_pack),
                       "--job.dump_folder", str(dump), "--training.seq_len", "32", "--training.steps", "8",
                       "--training.global_batch_size", "4", "--training.micro_batch_size", "2",
                       "--training.mixed_precision_param", "float32", "--training.bp_segment_len", "1",
                       "--metrics.log_freq", "1", "--eval.interval", "8", "--eval.tokens", "500",
                       "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "--checkpoint.interval", "4",
                       "--spike_guard.enable", "false", "--training.seed", "7"])
    trainer = Trainer(cfg, resolve(cfg, 1), CPU)
    assert isinstance(trainer.model, ModelProtocol)
    assert trainer.model.args.init_seed == 7  # training.seed reaches the model args
    assert trainer.train() == 0
    rows = [json.loads(line) for line in open(dump / "metrics.jsonl")]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert {"eval_loss_loop_1", "eval_loss_loop_2", "eval_loss_loop_3"} <= rows[-1].keys()
    assert trainer.model.bias_updates == 8  # once per step, through the protocol
    assert (dump / "checkpoint" / "step-8").is_dir()
