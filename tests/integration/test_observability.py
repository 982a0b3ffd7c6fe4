"""Seeing inside the loops on a tiny in-process run: routing-diversity scalars and heatmap images
in TensorBoard (read back through the event API), expert_load only at eval steps, profiler traces
that parse as JSON, and tools.analyze's report on the run's checkpoint."""

import contextlib
import dataclasses
import io
import json
import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torchtitan_loom.components.evaluation.held_out import HeldOutEval
from torchtitan_loom.components.observability import routing_plots
from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.tools import analyze
from torchtitan_loom.trainer import Trainer

CPU = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))
STEPS, EVAL_EVERY = 4, 2


@pytest.fixture(scope="module")
def run(tiny_pack, tmp_path_factory):
    """4 steps of the debug model (H = 3, L = 2, E = 8), eval and branch diagnostics at steps 2 and 4,
    profiling on."""
    dump = tmp_path_factory.mktemp("obs") / "run"
    argv = [
        "--data.path",
        str(tiny_pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.steps",
        str(STEPS),
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "4",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--eval.interval",
        str(EVAL_EVERY),
        "--eval.tokens",
        "400",
        "--spike_guard.enable",
        "false",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        str(STEPS),
        "--profiling.enable_profiling",
        "true",
        "--profiling.profile_freq",
        "2",
        "--profiling.profiler_warmup",
        "1",
        "--profiling.profiler_active",
        "1",
        "--profiling.enable_memory_snapshot",
        "true",
        "--metrics.diag_interval",
        "2",
        "--metrics.diag_grad",
        "true",
    ]
    cfg = load_config(argv)
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        trainer = Trainer(cfg, resolve(cfg, 1), CPU)
        assert trainer.train() == 0
    return dump, trainer, console.getvalue().splitlines()


def test_diversity_scalars_and_expert_load_only_at_eval(run):
    dump, trainer, _ = run
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(
        "expert_load" not in r for r in rows if "eval_loss" not in r
    )  # default: eval steps only
    last = evals[-1]
    assert len(last["expert_load"]) == 2 and len(last["expert_load"][0]) == 3
    H, E, k = 3, 8, trainer.model_args.routed_top_k
    assert k <= last["routing_distinct_experts"] <= min(E, H * k)
    for t in (1, 2):
        assert 0.0 <= last[f"routing_overlap_loop_{t}"] <= 1.0
        assert -1.0 <= last[f"stream_cos_loop_{t}"] <= 1.0
    for t in (1, 2, 3):
        assert 0.0 < last[f"routing_load_entropy_loop_{t}"] <= 1.0
        assert last[f"routing_load_max_mean_loop_{t}"] >= 1.0
        # Before the norms (after them it would be 1 by construction): a value that can move.
        assert 0.0 < last[f"stream_rms_loop_{t}"] < 1e3
        assert last[f"stream_rms_loop_{t}"] != pytest.approx(1.0, abs=1e-3)
    assert 0 <= last["routing_dead_experts"] <= E
    # The eval's diversity equals a direct recomputation on the same checkpointed model.
    direct, _ = trainer.parts.services.held_out.validate(trainer.state.step)
    assert direct["routing_distinct_experts"] == pytest.approx(last["routing_distinct_experts"])


def test_tensorboard_scalars_and_images(run):
    dump, trainer, _ = run
    acc = EventAccumulator(
        trainer.parts.training.metrics.tb_dir, size_guidance={"images": 0}
    )  # tb/<launch>/
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    for tag in (
        "routing/distinct_experts",
        "routing/overlap",
        "routing/load_entropy",
        "routing/dead_experts",
        "routing/overlap_loop_1",
        "stream/rms_loop_3",
        "stream/cos_loop_2",
        "eval/loss_loop_1",
    ):
        assert tag in scalars, tag
    assert [e.step for e in acc.Scalars("routing/distinct_experts")] == [2, 4]
    images = acc.Tags()["images"]
    assert sorted(images) == ["eval/loss_per_loop", "routing/load_layer_0", "routing/load_layer_1"]
    dpi = routing_plots.DPI
    heat = acc.Images("routing/load_layer_1")
    assert [e.step for e in heat] == [2, 4]
    assert (heat[-1].width, heat[-1].height) == tuple(
        round(x * dpi) for x in routing_plots.HEATMAP_SIZE_IN
    )
    curve = acc.Images("eval/loss_per_loop")[-1]
    assert (curve.width, curve.height) == tuple(round(x * dpi) for x in routing_plots.CURVE_SIZE_IN)
    assert heat[-1].encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"


def test_tensorboard_figures_carry_axes_labels_and_values():
    """The heatmap names its axes, has a colour bar and, for a debug-sized grid, each cell's
    value; the loss curve names its axes and prints the loss at every loop."""
    share_HE = torch.tensor([[0.5, 1.5, 1.0], [2.25, 0.0, 0.75]]).numpy()
    fig = routing_plots.heatmap_figure(share_HE, "expert load, layer 0")
    ax, bar = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == (
        "routed expert",
        "loop",
        "expert load, layer 0",
    )
    assert bar.get_ylabel() == routing_plots.SHARE_LABEL
    assert sorted(t.get_text() for t in ax.texts) == sorted(f"{v:.2f}" for v in share_HE.ravel())
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "2"]
    curve = routing_plots.loss_curve_figure([2.5, 2.25, 2.125], "loss").axes[0]
    assert curve.get_xlabel() == "exit after loop" and "loss" in curve.get_ylabel()
    assert [t.get_text() for t in curve.texts] == ["2.500", "2.250", "2.125"]
    image = routing_plots.heatmap_image(share_HE, "t")
    dpi = routing_plots.DPI
    assert image.shape == (3, *(round(x * dpi) for x in routing_plots.HEATMAP_SIZE_IN[::-1]))


def test_profiler_traces_are_json_and_memory_snapshot_message(run):
    dump, _, logs = run
    traces = sorted((dump / "profile_traces").glob("iteration_*/rank0_trace.json"))
    assert [p.parent.name for p in traces] == ["iteration_2", "iteration_4"]
    for path in traces:
        trace = json.loads(path.read_text())
        assert trace["traceEvents"], path
    assert any("enable_memory_snapshot" in m and "cpu" in m for m in logs)
    assert not (dump / "memory_snapshot").exists()


def test_profiling_config_errors():
    from torchtitan_loom.config import ConfigError

    cfg = load_config(["--profiling.profile_freq", "3", "--profiling.profiler_warmup", "3"])
    with pytest.raises(
        ConfigError, match=r"profiler_warmup \+ profiler_active = 4: must be ≤ profile_freq = 3"
    ):
        resolve(cfg, 1)
    cfg = load_config(["--metrics.expert_load_every", "-1"])
    with pytest.raises(ConfigError, match="metrics.expert_load_every = -1"):
        resolve(cfg, 1)


def test_analyze_writes_report(run, tmp_path, tiny_pack, capsys):
    dump, trainer, _ = run
    out = tmp_path / "report"
    # Same eval batches as the trainer's (tokens, rows), so the loss table must match its last eval.
    assert (
        analyze.main(
            [str(dump), "--out", str(out), "--tokens", "400", "--batch-rows", "4", "--samples", "2"]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith(  # said before the slow part
        f"analyze: loading {dump}, then routing 400 held-out tokens (rounded up to whole batches) "
        "through it ...\n"
    )
    report = (out / "report.md").read_text()
    for name in (
        "loss_per_loop.png",
        "load_layer_0.png",
        "load_layer_1.png",
        "doc_0.png",
        "doc_1.png",
    ):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name})" in report, name
    assert "## Routing diversity per layer" in report and "| 1 |" in report and "**mean**" in report
    assert (
        f"step {STEPS}" in report and str(tiny_pack) in report
    )  # the run's data.path from config.toml
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    expected = " | ".join(f"{rows[-1][f'eval_loss_loop_{t}']:.4f}" for t in (1, 2, 3))
    assert f"| loss | {expected} |" in report
    distinct = f"{rows[-1]['routing_distinct_experts']:.2f}"
    mean_row = next(line for line in report.splitlines() if line.startswith("| **mean** |"))
    assert mean_row.split(" | ")[1] == distinct
    # The branch diagnostics of steps 2 and 4: one figure per statistic, and the gradient norms.
    assert "## Branch diagnostics over training" in report
    for branch in ("attention", "moe"):
        for stat in ("norm", "var", "erank", "top_sv", "cos"):
            name = f"diag_{branch}_{stat}.png"
            assert (out / name).read_bytes()[
                :8
            ] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in report, name
    assert "](diag_grad_norm.png)" in report
    from torchtitan_loom.tools.analyze_diag import read_diagnostics

    data = read_diagnostics(str(dump / "metrics.jsonl"))
    grid = data["branch"][("attention", "erank")][4]
    assert grid.shape == (2, 3) and grid[1, 2] == pytest.approx(
        rows[-1]["diag/attention/erank/layer_1/loop_3"]
    )
    assert sorted(data["grad"]) == [2, 4]


def test_analyze_bad_input(tmp_path, capsys):
    assert analyze.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("analyze error:")
    assert analyze.main([str(tmp_path), "--tokens", "0"]) == 2


def test_the_eval_line_announces_the_holdout_tokens_it_reads(run, tiny_pack):
    dump, trainer, lines = run
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    read = next(r["eval_tokens"] for r in rows if r["step"] == 2)
    assert (
        f"[torchtitan_loom] eval at step 2: {read:,} holdout tokens, 3 loops ..." in lines
    )  # not eval.tokens
    # eval.tokens above what the holdout holds: the line gives the count read, and says so.
    t = trainer.cfg.training
    lines_big = []
    big = HeldOutEval(
        dataclasses.replace(trainer.cfg.eval, tokens=10**7),
        model=trainer.model,
        data_path=str(tiny_pack),
        val_path=None,
        seq_len=t.seq_len,
        vocab_size=trainer.model.args.vocab_size,
        batch_rows=t.global_batch_size,
        dp_rank=0,
        dp_world=1,
        tokenizer_name=None,
        device=trainer.parts.setting.device,
        micro_batches=trainer.parts.setting.micro_batches,
        autocast=trainer.parts.setting.autocast,
        stop_requested=lambda: 0,
        log=lines_big.append,
    )
    scalars, _ = big.validate(4)
    assert scalars["eval_tokens"] < 10**7
    assert lines_big[0] == (
        f"eval at step 4: {scalars['eval_tokens']:,} holdout tokens (the holdout holds fewer "
        f"than eval.tokens = 10,000,000), 3 loops ..."
    )


def test_step_lines_say_where_the_run_is(run):
    """step N/TOTAL on every line; an ETA from the second timed step on, none on the last; the
    checkpoint load and the eval are announced before they run."""
    _, _, lines = run
    step_lines = [ln for ln in lines if ln.startswith("[torchtitan_loom] step ")]
    assert [ln.split("|")[0].split()[-1] for ln in step_lines] == [
        f"{s}/{STEPS}" for s in range(1, STEPS + 1)
    ]
    etas = [re.search(r"\| eta (\d+ s|\d+ min \d\d s)(?: \||$)", ln) for ln in step_lines]
    assert etas[0] is None and etas[-1] is None and all(etas[1:-1]), step_lines
    assert any(ln.startswith("[torchtitan_loom] no checkpoint in ") for ln in lines)
