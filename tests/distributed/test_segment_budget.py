"""What a distributed train step costs per backprop segment, on 2 gloo ranks in one launch.

FSDP communicates once per backprop segment (parallelism.fsdp_sync = "segment", the default):
the same run with 1 and with 4 micro-batches per rank makes the same number of all-gathers and
reduce-scatters, counted on the torch.distributed ops FSDP2 dispatches (2 gloo ranks, debug model,
H = 3, K = 1, dp_shard 2, 2 counted steps). "micro_batch" makes them once per micro-batch (4×).

At K = 3 (one segment of 3 loops, every block used 3 times in it) still once per unit and
segment, with 1 and with 4 micro-batches: a third of K = 1's 3 segments (FSDP2's post-backward runs
once per use; the trainer defers each block's sync to its last use, parallelize.LoopedBlockSync).
After their first step (capacity and the bias update off, so both layouts route alike) those runs
hold the parameters and gradients of plain replicas (dp_replicate 2: no FSDP, one all-reduce of
every gradient) to fp32 rounding, with either fsdp_sync mode: the same sums in another order
(measured ≤ 1.7e-7 relative to each tensor's largest entry; a lost loop or micro-batch moves a
gradient by ~1e-1).

With 4 micro-batches, both settings train alike: the same micro-batches, the gradient sum only
in another order (fp32 accumulation of unsharded gradients, then one reduce-scatter, instead of a
reduce-scatter per micro-batch added to the sharded gradient): ~1e-7 relative per step; 3 steps of
AdamW with eps = 1e-3 keep that continuous, bound 1e-5. (1 vs 4 micro-batches is not that
comparison: capacity is decided per micro-batch, so the kept assignments differ.)

Expert parallel with capacity on (the default factor): exactly one device-to-host transfer per
segment, the step statistics, as without EP (the kept assignments travel in fixed slots, so no MoE
call reads split sizes from the device); with capacity off each MoE call adds its split sizes.
"""

import json
import os

import segment_budget_workers  # next to this file (conftest puts it on sys.path for the spawned ranks)
import torch

STEPS = 2
LAUNCH_TIMEOUT_S = 180.0
RS, AG = "_reduce_scatter_base_", "_allgather_base_"
PARITY_REL = 5e-7


def test_fsdp_and_expert_parallel_budgets_per_segment(tiny_pack, tmp_path, launch_ranks):
    base = [
        "--data.path",
        str(tiny_pack),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "8",
        "--model.num_loops",
        "3",
        "--training.bp_segment_len",
        "1",
        "--parallelism.dp_shard",
        "2",
        "--training.mixed_precision_param",
        "float32",
        "--optimizer.eps",
        "1e-3",
        "--metrics.enable_tensorboard",
        "false",
        "--eval.interval",
        "0",
        "--spike_guard.enable",
        "false",
    ]
    cases = [
        {"name": "segment_mb1", "argv": ["--training.micro_batch_size", "4"]},  # 4 rows per rank
        {"name": "segment_mb4", "argv": ["--training.micro_batch_size", "1"]},
        {
            "name": "micro_batch_mb4",
            "argv": ["--training.micro_batch_size", "1", "--parallelism.fsdp_sync", "micro_batch"],
        },
        {
            "name": "ep2_capacity",
            "argv": ["--training.micro_batch_size", "2", "--parallelism.ep", "2"],
            "sync_budget": True,
        },
        {
            "name": "ep2_no_capacity",
            "argv": [
                "--training.micro_batch_size",
                "2",
                "--parallelism.ep",
                "2",
                "--model.capacity_factor",
                "0",
            ],
        },
    ]
    k3 = ["--training.bp_segment_len", "3", "--model.capacity_factor", "0"]
    k3 += ["--model.load_balance_bias_lr", "0"]
    cases += [
        {"name": "k3_mb1", "argv": k3 + ["--training.micro_batch_size", "4"]},
        {"name": "k3_mb4", "argv": k3 + ["--training.micro_batch_size", "1"], "dump": True},
        {
            "name": "k3_mb4_micro_batch",
            "argv": k3
            + ["--training.micro_batch_size", "1", "--parallelism.fsdp_sync", "micro_batch"],
            "dump": True,
        },
        {
            "name": "k3_mb4_replicas",
            "argv": k3
            + ["--training.micro_batch_size", "1"]
            + ["--parallelism.dp_shard", "1", "--parallelism.dp_replicate", "2"],
            "dump": True,
        },
    ]
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(
        json.dumps({"base": base, "cases": cases, "out": str(tmp_path), "steps": STEPS})
    )
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    launch_ranks(
        segment_budget_workers.run,
        2,
        (2, str(tmp_path / "store"), str(spec_path)),
        LAUNCH_TIMEOUT_S,
        "fsdp sync",
    )
    got = {c["name"]: json.loads((tmp_path / f"{c['name']}.json").read_text()) for c in cases}
    one, four, per_mb = (got[c["name"]]["counts"] for c in cases[:3])
    assert one[RS] > 0 and one[AG] > 0, one
    assert (four[RS], four[AG]) == (one[RS], one[AG]), (
        f"1 micro-batch: {one}, 4 micro-batches: {four}"
    )
    assert (per_mb[RS], per_mb[AG]) == (4 * one[RS], 4 * one[AG]), per_mb
    deferred, per_step = (
        torch.tensor(got[n]["seg_losses"], dtype=torch.float64)
        for n in ("segment_mb4", "micro_batch_mb4")
    )
    rel = (deferred - per_step).abs() / per_step
    assert rel.max() <= 1e-5, rel.tolist()
    # K = 3: one reduce-scatter (and, "never" resharding, one all-gather) per unit and segment.
    k3_one, k3_four, k3_per_mb = (
        got[n]["counts"] for n in ("k3_mb1", "k3_mb4", "k3_mb4_micro_batch")
    )
    assert 3 * k3_one[RS] == one[RS] and 3 * k3_one[AG] == one[AG], (k3_one, one)
    assert (k3_four[RS], k3_four[AG]) == (k3_one[RS], k3_one[AG]), (k3_one, k3_four)
    assert (k3_per_mb[RS], k3_per_mb[AG]) == (4 * k3_one[RS], 4 * k3_one[AG]), k3_per_mb
    replicas = torch.load(tmp_path / "k3_mb4_replicas.pt")
    for name in ("k3_mb4", "k3_mb4_micro_batch"):
        fsdp = torch.load(tmp_path / f"{name}.pt")
        for param, (value, grad) in replicas.items():
            assert (grad is None) == (fsdp[param][1] is None), param
            for want, have in ((value, fsdp[param][0]), (grad, fsdp[param][1]))[
                : 1 + (grad is not None)
            ]:
                rel = ((have - want).abs().max() / want.abs().max()).item()
                assert rel <= PARITY_REL, f"{name} {param}: {rel:.2e}"
    # EP + capacity: the workers asserted 1 host sync per segment on every rank; rank 0's record:
    ep = got["ep2_capacity"]
    assert len(ep["host_syncs"]) == STEPS * ep["segments"], ep["host_syncs"]
    # Capacity off: + one split-size copy per MoE call (2 layers x 1 loop x 2 micro-batches).
    off = got["ep2_no_capacity"]
    assert len(off["host_syncs"]) == STEPS * off["segments"] * (1 + 2 * 1 * 2), off["host_syncs"]
