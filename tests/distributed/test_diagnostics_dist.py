"""Branch diagnostics on 2 gloo ranks through the real training loop (checks in diag_workers.py):
every statistic of every diagnostic step is in metrics.jsonl and TensorBoard under the same key,
the norm and variance equal a direct computation on both ranks' activations, the rank-collapse
trio equals the singular values of the logging rank's sampled rows, and a resumed launch keeps
the schedule (steps 2, 4, then 6)."""

import glob
import json

import diag_workers  # next to this file (conftest puts it on sys.path for the spawned ranks)
import pytest

LAUNCH_TIMEOUT_S = 180.0


def test_diagnostics_on_2_gloo_ranks_jsonl_tensorboard_and_direct_values(
    tiny_pack, tmp_path, launch_ranks
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    world, dump = 2, tmp_path / "run"
    base = [
        "--data.path",
        str(tiny_pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "8",
        "--training.micro_batch_size",
        "2",
        "--model.num_loops",
        "3",
        "--training.bp_segment_len",
        "2",
        "--training.mixed_precision_param",
        "float32",
        "--activation_checkpoint.mode",
        "none",
        "--eval.interval",
        "0",
        "--metrics.log_freq",
        "3",
        "--metrics.diag_interval",
        "2",
        "--metrics.diag_grad",
        "true",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--spike_guard.enable",
        "false",
    ]
    launch_ranks(
        diag_workers.run,
        world,
        (world, str(tmp_path / "store"), base, str(tmp_path)),
        LAUNCH_TIMEOUT_S,
        "diagnostics",
    )

    rows = [json.loads(line) for line in open(dump / "metrics.jsonl")]
    diag_rows = {r["step"]: r for r in rows if any(k.startswith("diag/") for k in r)}
    assert sorted(diag_rows) == [2, 4, 6]  # the resumed launch continues the schedule
    keys = {k for k in diag_rows[2] if k.startswith("diag/")}
    L, H, J = 2, 3, 2  # debug model: 2 layers; 3 loops; segments (1-2), (3)
    per_branch = 5 * L * H  # norm, var, erank, top_sv, cos per layer and loop
    groups = 2 * L + 2  # attention and MoE per layer, embedding, head
    assert len(keys) == 2 * per_branch + groups * J
    for step, row in diag_rows.items():
        assert {k for k in row if k.startswith("diag/")} == keys
        assert all(isinstance(row[k], float) for k in keys), step  # every value there, none null

    # TensorBoard: every diagnostic of every step, under the key itself (both launches).
    tb = {}
    for launch in sorted(glob.glob(str(dump / "tb" / "*"))):
        acc = EventAccumulator(launch, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            if tag.startswith("diag/"):
                for ev in acc.Scalars(tag):
                    tb[(tag, ev.step)] = ev.value
    for step, row in diag_rows.items():
        for k in keys:
            assert tb[(k, step)] == pytest.approx(row[k], rel=1e-6), (k, step)

    # Step 2 against the activations themselves.
    direct = [json.load(open(tmp_path / f"direct_rank{r}.json")) for r in range(world)]
    row = diag_rows[2]
    for key, values in direct[0]["moments"].items():
        both = values + direct[1]["moments"][key]  # every micro-batch of both ranks, loop by loop
        assert row[key] == pytest.approx(sum(both) / len(both), rel=1e-6), key
    assert len(direct[0]["trio"]) == 2 * 3 * L * H
    for key, value in direct[0]["trio"].items():  # metrics.log_rank 0's own sample
        assert row[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
