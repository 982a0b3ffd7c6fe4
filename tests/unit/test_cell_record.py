"""benchmarks/cell_record.py: a failed cell's reason names the real error, and the step-time spread."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cell_record import failure_reason, spread  # noqa: E402


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
