"""Metrics: JSONL lines, TensorBoard event files read back, peak-FLOP table, console line, throughput."""

import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torchtitan_loom.components.observability.metrics import (
    MetricsLogger,
    format_console_line,
    format_duration,
    memory_stats,
    peak_flops,
    peak_flops_for_name,
    tb_tag,
    throughput,
)
from torchtitan_loom.config.schema import Metrics


def _read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_jsonl_lines_written_and_flushed_per_call(tmp_path):
    logger = MetricsLogger(str(tmp_path), Metrics(enable_tensorboard=False))
    logger.log(
        1,
        {
            "loss": 3.5,
            "loss_segment_1": 4.0,
            "mfu": None,
            "skipped": False,
            "tokens": 2048,
            "grad_norm": torch.tensor(0.5),
        },
        extra={"expert_load": torch.tensor([[1, 2], [3, 4]])},
    )
    # Flushed immediately: readable before close.
    rows = _read_jsonl(tmp_path / "metrics.jsonl")
    assert rows == [
        {
            "step": 1,
            "loss": 3.5,
            "loss_segment_1": 4.0,
            "mfu": None,
            "skipped": 0,
            "tokens": 2048,
            "grad_norm": 0.5,
            "expert_load": [[1, 2], [3, 4]],
        }
    ]
    assert isinstance(rows[0]["loss"], float) and isinstance(rows[0]["tokens"], int)
    logger.log(2, {"loss": 3.25, "eval_loss": 3.3})
    logger.close()
    rows = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["eval_loss"] == 3.3
    assert not (tmp_path / "tb").exists()


def test_only_log_rank_writes(tmp_path):
    logger = MetricsLogger(str(tmp_path / "run"), Metrics(log_rank=0), rank=1)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_duplicate_and_bad_values_raise(tmp_path):
    with MetricsLogger(str(tmp_path), Metrics(enable_tensorboard=False)) as logger:
        with pytest.raises(ValueError, match="duplicate"):
            logger.log(1, {"loss": 1.0}, extra={"loss": 2.0})
        with pytest.raises(ValueError, match="'lr' must be a number"):
            logger.log(1, {"lr": "high"})


def test_tensorboard_scalars_read_back(tmp_path):
    with MetricsLogger(str(tmp_path), Metrics()) as logger:
        logger.log(1, {"loss": 3.5, "loss_segment_2": 3.75, "mfu": None})
        logger.log(2, {"loss": 3.0, "eval_loss_loop_3": 3.125})
    acc = EventAccumulator(logger.tb_dir)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"train/loss", "train/loss_segment_2", "eval/loss_loop_3"}  # None not written
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 3.5), (2, 3.0)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss_loop_3")] == [(2, 3.125)]


def test_tb_tag_mapping():
    assert tb_tag("loss") == "train/loss"
    assert tb_tag("loss_segment_1") == "train/loss_segment_1"
    assert tb_tag("eval_loss") == "eval/loss"
    assert tb_tag("eval_loss_loop_3") == "eval/loss_loop_3"
    assert tb_tag("routing_overlap_loop_2") == "routing/overlap_loop_2"
    assert tb_tag("stream_cos_loop_1") == "stream/cos_loop_1"


def test_peak_flops_table():
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for_name("NVIDIA H100 PCIe") == 756e12  # not the SXM entry
    assert peak_flops_for_name("NVIDIA H200") == 989e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for_name("NVIDIA B200") == 2250e12
    assert peak_flops_for_name("NVIDIA L40S") == 362e12
    assert peak_flops_for_name("AMD Instinct MI300X") == 1307e12
    assert peak_flops_for_name("NVIDIA GeForce GTX 1080") is None


def test_throughput():
    m = throughput(tokens=3000.0, seconds=3.0, flops_per_token=6e9, peak=989e12)
    assert m["tokens_per_s"] == pytest.approx(1000.0, rel=1e-12)
    assert m["tflops"] == pytest.approx(6.0, rel=1e-12)
    assert m["mfu"] == pytest.approx(100 * 6e12 / 989e12, rel=1e-12)
    assert throughput(1000.0, 1.0, 6e9, None)["mfu"] is None


def test_memory_stats_cpu():
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"memory_max_rss_gib"}
    # This test process has imported torch, so its peak RSS is well above 10 MiB and below 1 TiB.
    assert 0.01 < stats["memory_max_rss_gib"] < 1024


def test_console_line():
    line = format_console_line(
        42,
        {
            "loss": 3.14159,
            "loss_segment_2": 3.2,
            "loss_segment_1": 3.5,
            "lr": 2e-4,
            "grad_norm": 0.8,
            "tokens_per_s": 12345.6,
            "tflops": 1.5,
            "mfu": None,
            "memory_max_rss_gib": 1.25,
        },
    )
    assert line == (
        "step     42 | loss 3.1416 | seg 3.500/3.200 | lr 2.00e-04 | gnorm 0.800 | "
        "12,346 tok/s | 1.50 TFLOP/s | mem 1.25 GiB"
    )
    line = format_console_line(7, {"loss": math.nan, "mfu": 12.34, "skipped": True})
    assert "loss nan" in line and "mfu 12.3%" in line and line.endswith("SKIPPED")


def test_console_line_with_total_and_eta_and_durations():
    line = format_console_line(10, {"loss": 2.5, "eval_loss": 2.25}, total=20, eta_s=192.4)
    assert line == "step     10/20 | loss 2.5000 | eval 2.2500 | eta 3 min 12 s"
    assert [format_duration(s) for s in (0.4, 59.6, 61, 3 * 3600 + 5 * 60 + 9)] == [
        "0 s",
        "1 min 00 s",
        "1 min 01 s",
        "3 h 05 min",
    ]


def test_step_metrics_eta_and_compile_lines():
    """The ETA is the recent wall time per step (whatever ran between steps included, the first
    step's compile not) times the steps left; a compiled run says so before and after step 1."""
    from torchtitan_loom.components.observability import step_metrics

    clock = iter([0.0, 100.0, 102.0, 110.0, 112.0])  # start, step 1 (compiles), 2, 3 (+ eval), 4
    logged = []
    report = step_metrics.StepMetrics(
        Metrics(),
        None,
        tokens_per_step=1,
        flops_per_token=1.0,
        peak_flops=None,
        device=torch.device("cpu"),
        first_step=0,
        log=logged.append,
        total_steps=10,
        compiling=2,
        clock=lambda: next(clock),
    )
    assert logged == ["compiling 2 modules (first step) ..."]
    report.step_done(1)
    assert logged[-1] == "first step done in 100.0 s (compiling included)"
    assert report.eta_seconds(1) is None  # one timed step: no pace yet
    for step in (2, 3, 4):
        report.step_done(step)
    assert report.eta_seconds(4) == pytest.approx((112.0 - 100.0) / 3 * 6)
    assert report.eta_seconds(10) is None and len(logged) == 2


@pytest.mark.parametrize(
    "log_freq, first_step, total, expected",
    [
        (10, 0, 180, "training from step 1 to 180: a step line every 10 steps (metrics.log_freq), "
         "the first after step 10 ..."),
        (10, 180, 240, "training from step 181 to 240: a step line every 10 steps "
         "(metrics.log_freq), the first after step 190 ..."),
        (1, 0, 4, "training from step 1 to 4: a step line every 1 step (metrics.log_freq), the "
         "first after step 1 ..."),
        (50, 0, 4, "training from step 1 to 4: a step line every 50 steps (metrics.log_freq), the "
         "first after step 4 ..."),
    ],
)  # fmt: skip
def test_an_uncompiled_run_says_what_comes_before_its_first_step_line(
    log_freq, first_step, total, expected
):
    """The seconds before the first step line (up to log_freq steps) are announced: where the
    training starts, and after which step the first line comes (the last step's when sooner)."""
    from torchtitan_loom.components.observability import step_metrics

    logged: list[str] = []
    step_metrics.StepMetrics(
        Metrics(log_freq=log_freq),
        None,
        tokens_per_step=1,
        flops_per_token=1.0,
        peak_flops=None,
        device=torch.device("cpu"),
        first_step=first_step,
        log=logged.append,
        total_steps=total,
    )
    assert logged == [expected]
