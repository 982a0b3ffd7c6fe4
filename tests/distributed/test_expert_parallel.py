"""Expert parallelism (models/loom/infra/expert_parallel.py): index bookkeeping in-process, then one
4-process gloo launch (ep_workers.run) that checks, on ep = 4 and on ep = 2 sub-meshes of a 2x2
mesh: layer parity with the single-process LoomMoE (forward, kept counts, input and local
expert-weight grads; grouped and loop impls, and emulated MXFP8 float8 experts wrapped by EP;
capacity on (fixed slots) and off; experts and a rank with no rows), host copies per MoE call (none with capacity on, one with it off), bf16 grouped
GEMMs under autocast and under FSDP mixed precision, graph breaks under torch.compile only at the
dispatch point (_split_sizes, capacity off), the debug model built on meta == the single-process
model on each rank's own rows, and the ValueErrors for bad ep meshes."""

import ep_workers  # next to this file (conftest puts it on sys.path for the spawned ranks)
import torch

from torchtitan_loom.models.loom.infra.expert_parallel import _local_expert_order, _split_sizes

LAUNCHES = (
    30  # the limit, in bare-launch costs; the compile check traces on 4 ranks sharing the cores
)


def test_split_sizes_and_local_expert_order_on_a_hand_built_case():
    # W=2 sources, L=2 local experts. Received rows, source-major: s0 sends 2 rows for e0, 1 for
    # e1; s1 sends 0 for e0, 3 for e1. Grouped by local expert: e0 <- s0 rows 0,1; e1 <- s0 row 2,
    # then s1 rows 3,4,5.
    recv_WL = torch.tensor([[2, 1], [0, 3]])
    counts_E = torch.tensor([4, 0, 1, 2])  # what this rank sends: block 0 = 4 rows, block 1 = 3
    assert _split_sizes(counts_E, recv_WL) == ([4, 3], [3, 3], [2, 4])
    order, back = _local_expert_order(recv_WL, 6)
    assert order.tolist() == [0, 1, 2, 3, 4, 5]
    # Now s0: 1 row e0, 2 rows e1; s1: 2 rows e0, 1 row e1 -> grouped: e0 = rows 0, 3, 4; e1 = 1, 2, 5.
    order, back = _local_expert_order(torch.tensor([[1, 2], [2, 1]]), 6)
    assert order.tolist() == [0, 3, 4, 1, 2, 5]
    rows = torch.arange(6)
    assert torch.equal(rows[order][back], rows)
    assert _local_expert_order(torch.zeros(2, 2, dtype=torch.int64), 0)[0].numel() == 0


def test_expert_parallel_on_4_gloo_ranks(tmp_path, launch_ranks):
    world = 4
    launch_ranks(
        ep_workers.run, world, (world, str(tmp_path / "store")), LAUNCHES, "expert parallel"
    )
