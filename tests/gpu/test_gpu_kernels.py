"""What only a GPU can check: flex attention with backward, flash-attn, real float8 kernels
(dense Float8Linear on SM89+, routed experts fp8 rowwise on SM90 / MXFP8 on SM100), nccl.

Run by benchmarks/gpu_check.sh; every test is marked `gpu` and skips without CUDA.
"""

import datetime
import importlib.util
import socket

import pytest
import torch

from torchtitan_loom.models.loom import LoomTransformer, loom_flavors

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def debug_model(**changes) -> LoomTransformer:
    with torch.device("meta"):
        model = LoomTransformer(loom_flavors["debug"].replace(**changes))
    model.to_empty(device=DEVICE)
    with torch.no_grad():
        model.init_weights()  # layout-independent: the same weights for every backend
    return model


def batch(B=2, S=256, vocab=512):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    doc = torch.zeros(B, S, dtype=torch.long)
    doc[0, 100:] = 1  # two documents in row 0
    doc[1, 200:] = -1  # padding tail in row 1
    pos = torch.arange(S).expand(B, S).clone()
    pos[0, 100:] -= 100
    return [t.to(DEVICE) for t in (tokens, pos, doc)]


def loss_and_grads(model, inputs):
    out = model(*inputs)
    loss = out.logits_BSV.float().logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits_BSV.detach(), grads


def assert_backends_agree(backend: str, dtype: torch.dtype, tol: float) -> None:
    ref_model, model = debug_model(attn_backend="sdpa"), debug_model(attn_backend=backend)
    inputs = batch()
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        ref_logits, ref_grads = loss_and_grads(ref_model, inputs)
        logits, grads = loss_and_grads(model, inputs)
    valid = inputs[2] >= 0  # padding rows attend among themselves: compare real tokens
    torch.testing.assert_close(logits[valid], ref_logits[valid], rtol=tol, atol=tol)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        scale = ref_grads[name].abs().max().clamp_min(1e-6)
        assert ((grads[name] - ref_grads[name]).abs().max() / scale) < 20 * tol, name


def test_flex_attention_forward_and_backward_match_sdpa():
    assert_backends_agree("flex", torch.float32, 2e-4)


def test_auto_backend_on_cuda_in_bf16_matches_sdpa_and_experts_take_bf16_grouped_gemm():
    # auto = flash_attn when installed, else flex; the model's mask names the kernel it chose.
    from torch.overrides import TorchFunctionMode

    class GroupedCalls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.dtypes, self.host = [], 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name == "_grouped_mm":
                self.dtypes.append((args[0].dtype, args[1].dtype))
            self.host += name in ("item", "tolist")
            return func(*args, **(kwargs or {}))

    model = debug_model()
    with GroupedCalls() as mode, torch.autocast("cuda", dtype=torch.bfloat16):
        model(*batch())
    assert mode.dtypes and set(mode.dtypes) == {(torch.bfloat16, torch.bfloat16)}, mode.dtypes
    # No .item()/.tolist() in the forward (flash_attn's cu_seqlens sync through nonzero instead).
    assert mode.host == 0, mode.host
    assert_backends_agree("auto", torch.bfloat16, 3e-2)


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed"
)
def test_flash_attn_forward_and_backward_match_sdpa():
    assert_backends_agree("flash_attn", torch.bfloat16, 3e-2)


# ---------------------------------------------------------------------------- real float8
needs_sm89 = pytest.mark.skipif(
    capability() < (8, 9), reason="real float8 needs compute capability 8.9+"
)
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao not installed"
)


def expert_kernel() -> str | None:
    return {9: "fp8_rowwise", 10: "mxfp8"}.get(capability()[0])


@needs_torchao
@needs_sm89
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_real_float8_training_tracks_bf16(recipe, tiny_pack, tmp_path):
    from torchao.float8.float8_linear import Float8Linear

    from torchtitan_loom.config import load_config
    from torchtitan_loom.config.validate import resolve
    from torchtitan_loom.distributed.utils import DistInfo
    from torchtitan_loom.trainer import Trainer

    info = DistInfo(rank=0, world_size=1, device=torch.device(DEVICE, 0))

    def curve(*extra):
        argv = [
            "--data.path",
            str(tiny_pack),
            "--job.dump_folder",
            str(tmp_path / "_".join(extra or ["bf16"])),
            "--training.device",
            "cuda",
            "--training.seq_len",
            "32",
            "--training.global_batch_size",
            "8",
            "--training.micro_batch_size",
            "8",
            "--training.bp_segment_len",
            "1",
            "--training.steps",
            "10",
            "--optimizer.lr",
            "1e-3",
            "--training.mixed_precision_param",
            "bfloat16",
            "--metrics.enable_tensorboard",
            "false",
            "--eval.interval",
            "0",
            "--spike_guard.enable",
            "false",
            *extra,
        ]
        cfg = load_config(argv)
        tr = Trainer(cfg, resolve(cfg, 1), info)
        it = iter(tr.dataloader)
        return torch.tensor([tr.train_step(next(it)).seg_losses[-1] for _ in range(10)]), tr

    ref, _ = curve()
    experts = "true" if expert_kernel() else "false"
    got, tr = curve("--float8.enable", "--float8.recipe", recipe, "--float8.experts", experts)
    assert any(isinstance(m, Float8Linear) for m in tr.model.modules())
    assert torch.isfinite(got).all() and got[-1] < got[0] - 2.0, got.tolist()
    # The CPU emulation test allows 0.06; real kernels (fast accumulation) get a little more room.
    assert (got - ref).abs().max() < 0.1, (got.tolist(), ref.tolist())


@needs_torchao
@pytest.mark.skipif(
    expert_kernel() is None, reason="float8 grouped GEMMs need SM90 (fp8 rowwise) or SM100 (MXFP8)"
)
def test_real_float8_grouped_experts_close_to_bf16():
    from torchtitan_loom.components.quantization.float8 import EXPERT_ALIGNMENT, EXPERT_DIM_MULTIPLE
    from torchtitan_loom.components.quantization.grouped_gemm import grouped_kernel
    from torchtitan_loom.models.loom.float8_experts import Float8GroupedExperts
    from torchtitan_loom.models.loom.moe import RoutedExperts

    kernel = expert_kernel()
    torch.manual_seed(0)
    experts = RoutedExperts(8, 256, 512, "grouped").to(
        DEVICE, torch.bfloat16
    )  # bf16 like FSDP's params
    with torch.no_grad():
        experts.w13.normal_(std=256**-0.5), experts.w2.normal_(std=512**-0.5)
    counts_E = torch.tensor([300, 0, 700, 5, 640, 1, 333, 53], device=DEVICE)
    x_AD = torch.randn(
        int(counts_E.sum()), 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True
    )
    ref = experts(x_AD, counts_E)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (x_AD, experts.w13, experts.w2))
    f8 = Float8GroupedExperts(
        experts, grouped_kernel(kernel, EXPERT_ALIGNMENT[kernel], EXPERT_DIM_MULTIPLE[kernel])
    )
    out = f8(x_AD, counts_E)
    grads = torch.autograd.grad(out.float().square().sum(), (x_AD, f8.w13, f8.w2))
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert 1e-4 < rel < 0.15, rel
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all()
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 0.25


# ---------------------------------------------------------------------------- nccl
def test_nccl_with_one_rank():
    import torch.distributed as dist

    from torchtitan_loom.distributed import utils as dist_utils

    if not dist.is_nccl_available():
        pytest.skip("this torch build has no nccl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
        device_id=torch.device(DEVICE, 0),
    )
    try:
        t = torch.arange(4.0, device=DEVICE)
        dist.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        p = torch.nn.Parameter(torch.ones(3, device=DEVICE))
        p.grad = torch.full((3,), 2.0, device=DEVICE)
        dist_utils.reduce_gradients([p], torch.float32)
        assert dist_utils.grads_finite([p]) and p.grad.tolist() == [2.0, 2.0, 2.0]
        dist.barrier()
    finally:
        dist.destroy_process_group()
