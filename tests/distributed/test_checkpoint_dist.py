"""Checkpointing on 2 gloo processes (one launch, checks in checkpoint_workers.py): async save
over its own group racing neither the training collectives nor the next updates; a preemption
signal seen by one rank stops all of them after the same step."""

import checkpoint_workers  # next to this file (conftest puts it on sys.path for the spawned ranks)

LAUNCHES = 24  # the limit, in bare-launch costs (tests/launch_cost.py)


def test_async_save_and_preemption_on_2_gloo_ranks(tmp_path, launch_ranks):
    world = 2
    launch_ranks(
        checkpoint_workers.run,
        world,
        (world, str(tmp_path / "store"), str(tmp_path / "run")),
        LAUNCHES,
        "checkpoint",
    )
