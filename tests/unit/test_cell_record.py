"""benchmarks/cell_record.py: a failed cell's reason names the real error, and the step-time spread."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cell_record import failure_reason, spread


class BackendCompilerFailed(Exception):
    """Shaped like torch._dynamo's: the compiler's error kept as `inner_exception`."""

    def __init__(self, inner):
        super().__init__("backend='inductor' raised:\n" + str(inner) + "\n\nSet TORCH_LOGS=+dynamo")
        self.inner_exception = inner


def test_an_inductor_failure_reads_as_its_cause():
    inner = AssertionError("\nExpected self.size(1) to be divisible by 16, got 8184")
    reason = failure_reason(BackendCompilerFailed(inner))
    assert reason == (
        "BackendCompilerFailed -> AssertionError: Expected self.size(1) to be divisible by 16, "
        "got 8184"
    )


def test_a_plain_error_and_a_cause_chain():
    assert failure_reason(ValueError("bad\nsecond line")) == "ValueError: bad"
    try:
        try:
            raise KeyError("inner")
        except KeyError as exc:
            raise RuntimeError("wrapper") from exc
    except RuntimeError as exc:
        assert failure_reason(exc) == "RuntimeError -> KeyError: 'inner'"


def test_spread_of_the_step_times():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {
        "step_time_min_s": 1.0,
        "step_time_median_s": 2.5,
        "step_time_max_s": 10.0,
    }


def test_a_cut_cell_says_how_far_it_got_and_a_finished_one_says_nothing():
    from cell_record import progress_note, progress_record

    running = progress_record("warm-up step 2/2", 0.0, 12.5, [81.2], [], None)
    assert running["status"] == "running" and running["steps_done"] == 1
    assert running["warmup_first_step_s"] == 81.2 and running["graphs_compiled"] is None
    cut = {**running, "status": "timed out", "compile_times_s": [40.1, 2.5]}
    assert progress_note(cut) == (
        "1 steps done (warm-up s: 81.2); build 12.5 s; 2 graph compiles finished (40.1, 2.5 s); "
        "cut during warm-up step 2/2"
    )
    assert progress_note({**cut, "status": "ok"}) == ""
