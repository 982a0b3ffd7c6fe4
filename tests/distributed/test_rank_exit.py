"""A spawned test rank leaves without the interpreter's finalization once its function returns,
and a rank that raises still reports its error (tests/rank_exit.py says why).

Finalization starts with the atexit handlers, so a handler's mark is the witness: written by a
rank started the plain way (which shows the witness works), absent from one started through the
launcher.
"""

import atexit
import os

import pytest
import torch.multiprocessing as mp


def _mark(path: str) -> None:
    with open(path, "w") as fh:
        fh.write("finalized")


def _rank_with_exit_handler(rank: int, folder: str) -> None:
    atexit.register(_mark, os.path.join(folder, f"finalized.{rank}"))
    _mark(os.path.join(folder, f"ran.{rank}"))


def _failing_rank(rank: int) -> None:
    raise ValueError(f"rank {rank} failed on purpose")


def test_a_rank_leaves_without_finalization_after_its_function_returns(tmp_path, launch_ranks):
    plain, launched = tmp_path / "plain", tmp_path / "launched"
    plain.mkdir()
    launched.mkdir()
    mp.start_processes(_rank_with_exit_handler, args=(str(plain),), nprocs=2, start_method="spawn")
    assert sorted(os.listdir(plain)) == ["finalized.0", "finalized.1", "ran.0", "ran.1"]
    launch_ranks(_rank_with_exit_handler, 2, (str(launched),), 10.0, "exit witness")
    assert sorted(os.listdir(launched)) == ["ran.0", "ran.1"]


def test_a_rank_that_raises_still_reports_its_error(launch_ranks):
    with pytest.raises(mp.ProcessRaisedException, match="rank . failed on purpose"):
        launch_ranks(_failing_rank, 2, (), 10.0, "failing rank")
