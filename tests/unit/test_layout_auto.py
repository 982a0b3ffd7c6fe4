"""parallelism.layout = "auto": the layout the trainer runs is the fastest the dry run ranks (the
same estimate), pinned degrees and the config's rules hold, and the estimate's report says per rank
or all ranks, hides FSDP behind the compute only when it is, totals the per-layer rows and names
the padding of experts split over more ranks than there are experts."""

import re
from pathlib import Path

import pytest

from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.estimate import estimate, layout_name, rank_layouts, report

CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"  # cwd-independent

PRESET = ["--job.config_file", f"{CONFIGS}/loom_1p7b.toml", "--parallelism.dry_run"]


def cfg_of(*argv: str):
    return load_config(PRESET + list(argv))


def test_presets_for_gpus_choose_their_layout():
    for preset in ("loom_329m", "loom_1p7b", "loom_1p7b_float8"):
        cfg = load_config(["--job.config_file", f"{CONFIGS}/{preset}.toml"])
        assert cfg.parallelism.layout == "auto", preset
    assert load_config([]).parallelism.layout == "degrees"  # the CPU default: degrees as written


def test_auto_runs_the_fastest_ranked_layout_at_64_ranks():
    cfg = cfg_of()
    assert cfg.parallelism.layout == "auto"
    args, dims = resolve(cfg, 64)
    ranked = rank_layouts(cfg, args, 64)
    assert (dims.dp_replicate, dims.dp_shard, dims.ep) == (
        ranked[0].dims.dp_replicate,
        ranked[0].dims.dp_shard,
        ranked[0].dims.ep,
    )
    # The dry run's own ranking says the same layout is first, and it beats the written degrees.
    written_args, written = resolve(cfg_of("--parallelism.layout", "degrees"), 64)
    assert written.dp_shard == 64 and written.dp_replicate == 1
    text = "\n".join(report(cfg, args, dims))
    first = re.search(r"layouts of 64 ranks.*\n    (.+?):", text)[1]
    assert first == layout_name(dims)
    # dp_shard 64 gathers every block over the network: slower than the layout chosen, which is
    # the fastest of all the ranked ones.
    chosen = estimate(cfg, args, dims).step_s
    assert chosen < estimate(cfg, written_args, written).step_s
    assert chosen == pytest.approx(min(r.estimate.step_s for r in ranked), abs=5e-4)  # ms ties
    # One line with the choice and the runner-up, kept with the degrees for the start-up log.
    assert dims.origin.startswith(f"layout auto: {layout_name(dims)} (estimated ")
    assert f"runner-up {layout_name(ranked[1].dims)}" in dims.origin
    assert dims.origin in dims.describe()


def test_pinned_degrees_win_and_float8_experts_may_take_ep():
    args, dims = resolve(cfg_of("--parallelism.ep", "2"), 64)
    assert dims.ep == 2
    args, dims = resolve(cfg_of("--parallelism.dp_shard", "16"), 64)
    assert dims.dp_shard == 16 and dims.dp_replicate == 4
    f8_preset = ["--job.config_file", f"{CONFIGS}/loom_1p7b_float8.toml", "--float8.emulate"]
    f8_preset += ["--compile.enable", "false"]  # emulated float8 experts do not compile on CPU
    f8_preset += ["--parallelism.dry_run"]  # no corpus needed
    f8 = load_config(f8_preset)
    assert f8.float8.experts
    args = resolve(f8, 64).model_args
    # Float8 routed experts run under EP: the auto choice ranks every layout, EP ones too, and
    # takes the fastest (the same as an unrestricted ranking's first).
    ranked = rank_layouts(f8, args, 64)
    assert any(r.dims.ep > 1 for r in ranked)
    assert layout_name(resolve(f8, 64).dims) == layout_name(ranked[0].dims)
    # A written EP degree with float8 experts is valid.
    written = ["--parallelism.layout", "degrees", "--parallelism.ep", "2"]
    assert resolve(load_config(f8_preset + written), 64).dims.ep == 2
    # Pinned: EP 1 when asked, the other degrees chosen.
    assert resolve(load_config(f8_preset + ["--parallelism.ep", "1"]), 64).dims.ep == 1


def test_no_valid_layout_is_one_line_naming_the_pins():
    with pytest.raises(ConfigError) as err:
        resolve(cfg_of("--parallelism.dp_shard", "7"), 64)
    lines = str(err.value).splitlines()
    assert any("parallelism.layout = 'auto': no valid layout of 64 ranks with " in x for x in lines)
    assert any("parallelism.dp_shard = 7" in x for x in lines)


def test_one_rank_and_bad_choice():
    args, dims = resolve(cfg_of(), 1)
    assert dims.world_size == 1 and dims.origin == ""
    with pytest.raises(ConfigError, match="parallelism.layout"):
        load_config(PRESET + ["--parallelism.layout", "fastest"])


def test_report_says_per_rank_or_all_ranks_and_totals_the_layer_rows():
    cfg = cfg_of("--parallelism.layout", "degrees")
    args, dims = resolve(cfg, 64)  # dp_shard 64: the collectives outlast the compute
    est = estimate(cfg, args, dims)
    assert est.overlapped_s > est.compute_s
    text = "\n".join(report(cfg, args, dims))
    assert "behind the compute" not in text
    assert f"longer than the compute by {est.overlapped_s - est.compute_s:.2f} s" in text
    assert "tokens/s over all ranks" in text and "on each rank;" in text
    assert f"{est.flops * 64 / 1e12:,.1f} TFLOP model over all 64 ranks" in text
    # Per-layer rows say × 15; the total is every collective of the step, each layer counted.
    assert "layers.{l} (per unit, × 15)" in text
    total = float(re.search(r"^    total\s+every unit.*?([\d.]+)\s+[\d.]+$", text, re.M)[1])
    assert total == pytest.approx(
        sum(c.calls * c.nbytes for c in est.collectives) / 2**30, abs=2e-3
    )
    # 30 routed experts split over 64 ranks are padded to 64 rows: said, with the factor.
    pad = re.search(r"padding: layers\.\{l\} gathers and reduce-scatters ([\d.]+)×", text)
    assert pad and float(pad[1]) > 1.5 and "rounds a size of 30 up to a multiple of 64" in text
    # Where the collectives fit under the compute, the report says they are hidden.
    auto_args, auto_dims = resolve(cfg_of(), 64)
    fast = estimate(cfg_of(), auto_args, auto_dims)
    assert fast.overlapped_s <= fast.compute_s
    assert "(hidden behind the compute)" in "\n".join(report(cfg_of(), auto_args, auto_dims))
    small = re.search(
        r"padding: .*? ([\d.]+)× its", "\n".join(report(cfg_of(), auto_args, auto_dims))
    )
    assert float(small[1]) < 1.1  # 30 experts over 8 ranks pad to 32 rows only
