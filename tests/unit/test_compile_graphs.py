"""One graph per block (issue 12, item 2): torch.compile of each block without expert parallelism,
as the trainer applies it (fullgraph), over a whole segmented step (3 segments: fresh and carried
memories, forward and backward), in fp32 and under bf16 autocast, with activation checkpointing
none and per loop: no graph break, at most one recompile after the first loop, and under bf16
every block graph runs the routed experts with the grouped GEMM and holds no host sync.

The backend records the FX graphs dynamo hands it and runs them eagerly: dynamo's tracing, guards
and recompiles without code generation, so the check is quick on CPU.
"""

import pytest
import torch
from batches import two_document_batch  # tests/unit/batches.py
from torch._dynamo.utils import counters

from torchtitan_loom.components.loss import token_ce_sum
from torchtitan_loom.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtitan_loom.distributed.model_wrappers import apply_compile
from torchtitan_loom.models.loom import LoomTransformer, loom_flavors

HOST_SYNC_TARGETS = ("item", "tolist", "_local_scalar_dense")


_batch = two_document_batch


def _targets(gm: torch.fx.GraphModule) -> set[str]:
    return {
        getattr(n.target, "__name__", str(n.target))
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method")
    }


@pytest.mark.parametrize("ac", ["none", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_block_one_graph_no_break(dtype, ac):
    graphs: list[set[str]] = []

    def recording_backend(gm, example_inputs):
        graphs.append(_targets(gm))
        return gm.forward

    model = LoomTransformer(loom_flavors["debug"].replace(num_loops=6))
    model.init_weights()
    if ac != "none":
        apply_activation_checkpointing(
            model, ac, save_routing=False
        )  # as parallelize does under compile
    apply_compile(list(model.layers), backend=recording_backend, fullgraph=True)
    after_loop = {}
    inner = model.region_wrappers.get("loop")

    def loop_region(fn, t, *args):  # the model's seam: notes the graph count when each loop ends
        out = fn(t, *args) if inner is None else inner(fn, t, *args)
        after_loop.setdefault(t, len(graphs))
        return out

    model.region_wrappers["loop"] = loop_region
    tokens, positions, doc_ids = _batch()
    torch._dynamo.reset()
    counters.clear()
    try:
        carry = None
        for a, b in ((1, 2), (3, 4), (5, 6)):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                out = model(tokens, positions, doc_ids, loop_start=a, loop_end=b, carry=carry)
            token_ce_sum(out.logits_BSV, tokens).backward()
            carry = out.carry.detach()
        breaks = dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    assert breaks == {}, breaks
    # Loop 1 compiles the fresh-memory variants; later loops and segments may add one at most.
    assert 1 <= after_loop[1] and len(graphs) - after_loop[1] <= 1, (after_loop, len(graphs))
    if dtype == torch.bfloat16:
        assert all("_grouped_mm" in g for g in graphs), graphs
        assert not any(g & set(HOST_SYNC_TARGETS) for g in graphs), graphs
