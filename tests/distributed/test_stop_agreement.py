"""Stop agreement has one collective path: every rank's stop flag rides in each segment's step
statistics (the step's one all-reduce per segment), so on 2 gloo ranks a loop iteration of the
real Trainer (the step, then metrics, divergence check, checkpoint policy and the stop decision)
costs the same collectives and host syncs with the stop signals watched (checkpoints on) as
without; and a SIGTERM that reaches only rank 1 in the middle of step 3 still stops both ranks
before that step's first update (both exit 0 at step 2).

Per iteration, with S backprop segments: host syncs = S (the statistics, utils.py) + 2 (the
divergence monitor's check of the weights: its local read and its agreed flag, integrity.py).
Before, the stop decision added one all-reduce and one ``.item()`` to every iteration
(PreemptionWatcher.stop_after called requested(), an all-reduce).
"""

import json

import stop_agreement_workers  # next to this file (conftest puts it on sys.path for the spawned ranks)

LAUNCHES = 24  # the limit, in bare-launch costs (tests/launch_cost.py): two short runs per rank


def test_one_stop_agreement_path_per_step(tiny_pack, tmp_path, launch_ranks):
    base = [
        "--data.path",
        str(tiny_pack),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--training.steps",
        "5",
        "--model.num_loops",
        "4",
        "--training.bp_segment_len",
        "2",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.log_freq",
        "1000",
        "--eval.interval",
        "0",
    ]
    checkpoints = ["--checkpoint.enable", "--checkpoint.interval", "1000"]
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(
        json.dumps({"base": base, "checkpoints": checkpoints, "out": str(tmp_path)})
    )
    launch_ranks(
        stop_agreement_workers.run,
        2,
        (2, str(tmp_path / "store"), str(spec_path)),
        LAUNCHES,
        "stop agreement",
    )
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        on, off = got["watched"], got["unwatched"]
        assert on["code"] == off["code"] == 0
        s = on["segments"]
        assert s == 2 and len(on["iterations"]) == len(off["iterations"]) == 2
        for watched, unwatched in zip(on["iterations"], off["iterations"]):
            assert watched == unwatched, (rank, watched, unwatched)
            files = [where.split(":")[0] for where in watched["host_syncs"]]
            assert files == ["utils.py"] * s + ["integrity.py"] * 2, watched["host_syncs"]
        signalled = got["signalled"]
        assert signalled["received"] == (15 if rank == 1 else 0), signalled
        assert signalled["code"] == 0 and signalled["step"] == 2, (rank, signalled)
