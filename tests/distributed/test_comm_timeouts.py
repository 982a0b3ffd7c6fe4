"""[comm] timeouts reach the process groups (see comm_workers.py); the launcher's limit is measured launch costs."""

import json
import socket

import comm_workers  # next to this file (conftest puts it on sys.path for the spawned ranks)
import pytest

LAUNCHES = 18  # the limit, in bare-launch costs (tests/launch_cost.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_and_train_timeouts_reach_every_group(tmp_path, launch_ranks):
    launch_ranks(comm_workers.run, 2, (2, _free_port(), str(tmp_path)), LAUNCHES, "comm timeouts")
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["init_s"] == comm_workers.INIT_S
        assert r["mesh_groups"] >= 1
        assert r["after_s"] == [comm_workers.TRAIN_S] * (1 + r["mesh_groups"])
    failed = json.loads((tmp_path / "rank0.json").read_text())["failed_after_s"]
    # Under the train timeout, far below the 37 s init timeout (slack for a loaded machine).
    assert failed is not None and comm_workers.TRAIN_S - 0.5 <= failed < comm_workers.INIT_S - 10


def test_the_launch_limit_is_a_multiple_of_the_measured_launch_cost(launch_cost_s, launch_ranks):
    from tests import launch_cost

    assert launch_cost.FLOOR_S <= launch_cost_s < launch_cost.MEASURE_LIMIT_S
    # Two ranks of a world of three never get past init: stopped at 0.05 launch costs.
    with pytest.raises(
        pytest.fail.Exception,
        match=rf"within {0.05 * launch_cost_s:.0f} s \(0.05 × the "
        rf"{launch_cost_s:.1f} s a bare launch took\)",
    ):
        launch_ranks(launch_cost._bare_rank, 2, (3, _free_port()), 0.05, "never completes")
