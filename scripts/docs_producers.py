"""One producer per marked region of the docs: the commands it runs (as the docs show them), the text
it writes from what they printed, the paths its text describes, and how CI checks it without a
refresh (scripts/docs_context.py says what each field means). Runs that feed several regions (the
default run, the short run with checkpoints) happen once, on first use.

The producers live by topic: docs_producers_runs.py (training runs and the tools on them),
docs_producers_layout.py (sizes, the dry run, the FSDP benchmarks), docs_producers_figures.py (the
figures of the estimate and the cost model quoted in the prose, the protocol's surface),
docs_producers_depth.py (the depth study and the depth reports of docs/studying_depth.md),
docs_producers_exit.py (its study of the depth methods: training past H, the learned exit).
"""

from __future__ import annotations

import docs_producers_depth as depth
import docs_producers_exit as exit_study
import docs_producers_figures as fig
import docs_producers_layout as lay
import docs_producers_runs as runs
from docs_context import (
    ANALYZE,
    DEFAULT_RUN,
    DIAG_COST,
    DRY_RUN,
    GENERATE,
    HF_EXPORT,
    HF_SNIPPET,
    LM_EVAL,
    MEMORY_TIME,
    METRICS_SIZE,
    MOE_BY_OP,
    RESHARD,
    RUNS,
    SHORT_RUN,
    Context,
    Producer,
)

__all__ = ["PRODUCERS", "Context", "Producer"]

CODE = ("torchtitan_loom", "train_configs")  # what a figure of the code and presets describes
LM_TASKS = (*RUNS, "tests/inference/tiny_tasks")

PRODUCERS: dict[str, Producer] = {
    "default-run-console": Producer((DEFAULT_RUN,), runs.default_run_console, check="figures"),
    "train-duration": Producer((), runs.train_duration),
    "install-duration": Producer((), runs.install_duration, "install", ("pyproject.toml",)),
    "suite-duration": Producer(
        (), runs.suite_duration, "suite_log", ("torchtitan_loom", "tests", ".ci/run")
    ),
    "preset-sizes": Producer((), lay.preset_sizes, sources=CODE, check="exact"),
    "dry-run-console": Producer((DRY_RUN,), lay.dry_run_console, sources=CODE, check="exact"),
    "dry-run-estimates": Producer((), lay.dry_run_estimates, sources=CODE, check="exact"),
    "fsdp-sync-volume": Producer((), fig.fsdp_sync_volume, sources=CODE, check="exact"),
    "reshard-table": Producer(
        (RESHARD,), lay.reshard_table, sources=(*CODE, "benchmarks/memory_time.py")
    ),
    "flat-fsdp-scaling": Producer((), fig.flat_fsdp_scaling, sources=CODE, check="exact"),
    "capacity-slots": Producer((), fig.capacity_slots, sources=CODE, check="exact"),
    "memory-time-table": Producer(
        (MEMORY_TIME,), lay.memory_time_table, sources=(*CODE, "benchmarks/memory_time.py")
    ),
    "flex-scores-size": Producer((), fig.flex_scores_size, sources=CODE, check="exact"),
    "checksum-cost": Producer((), lay.checksum_cost, sources=CODE),
    "metrics-size": Producer(
        (METRICS_SIZE,), runs.metrics_size, sources=(*CODE, "benchmarks/metrics_size.py")
    ),
    "debug-routing-shape": Producer((), fig.debug_routing_shape, sources=CODE, check="exact"),
    "diag-cost": Producer((DIAG_COST,), runs.diag_cost, sources=(*CODE, "benchmarks/diag_cost.py")),
    "moe-layer-by-op": Producer(
        (MOE_BY_OP,), lay.moe_layer_by_op, sources=(*CODE, "benchmarks/moe_layer.py")
    ),
    "analysis-tables": Producer((DEFAULT_RUN, ANALYZE), runs.analysis_tables, check="figures"),
    "short-run": Producer((SHORT_RUN,), runs.short_run),
    "generate-console": Producer((GENERATE,), runs.generate_console),
    "lm-eval-console": Producer((LM_EVAL,), runs.lm_eval_console, sources=LM_TASKS),
    "hf-export-console": Producer((HF_EXPORT, HF_SNIPPET), runs.hf_export_console),
    "depth-study": Producer((depth.STUDY, depth.COMPARE), depth.study_table),
    "depth-report": Producer((depth.DEPTH_H3,), depth.depth_report),
    "depth-training": Producer((depth.DEPTH_SAMPLED,), depth.depth_training),
    "depth-generate": Producer((depth.GENERATE_EXIT,), depth.generate_exit),
    "h6-study": Producer(
        (exit_study.STUDY_FIXED, exit_study.STUDY_METHODS, exit_study.COMPARE),
        exit_study.study_table,
    ),
    "h6-past-h": Producer(
        (exit_study.DEPTH_FIXED, exit_study.DEPTH_LEARNED), exit_study.past_h_table
    ),
    "h6-learned-exit": Producer((), exit_study.learned_table),
    "protocol-surface": Producer(
        (),
        fig.protocol_surface,
        sources=(
            "torchtitan_loom/protocols.py",
            "torchtitan_loom/loop_request.py",
            "torchtitan_loom/model_cost.py",
        ),
        check="exact",
    ),
}
