"""Every given value is applied or refused (issue 42): an ablation given on the command line trains
what the same value in a TOML file trains (not the recipe), --help shows what a command runs,
the config file read is the one recorded, a file cannot name another, a flavor chosen on the
command line is not outranked by a preset's [model] values, a key whose feature is off is
refused, degrees given under layout auto are pinned, and warmup given twice in one source is
refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchtitan_loom import train
from torchtitan_loom.config import ConfigError, help_text, load_config
from torchtitan_loom.config.gates import gated_problems
from torchtitan_loom.config.validate import resolve

CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"
DEBUG = ["--job.config_file", str(CONFIGS / "debug_model.toml")]


def _tiny(pack, dump):
    return [
        *("--data.path", str(pack), "--job.dump_folder", str(dump)),
        *("--training.seq_len", "32", "--training.global_batch_size", "4"),
        *("--training.micro_batch_size", "4", "--training.steps", "3"),
        *("--metrics.log_freq", "1", "--eval.interval", "0"),
        *("--metrics.enable_tensorboard", "false"),
    ]


def _losses(dump: Path) -> list[float]:
    rows = [json.loads(ln) for ln in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize(
    "key,value,toml",
    [
        ("model.ffn_branch_rms", "none", '"none"'),
        ("model.embed_inject_mode", "none", '"none"'),
        ("model.cycle_residual_scale", "false", "false"),
    ],
)
def test_an_ablation_on_the_command_line_trains_what_the_toml_file_trains(
    tiny_pack, tmp_path, key, value, toml
):
    base = [*DEBUG, *_tiny(tiny_pack, tmp_path / "recipe")]
    assert train.main(base) == 0
    assert train.main([*DEBUG, *_tiny(tiny_pack, tmp_path / "cli"), f"--{key}", value]) == 0
    sec, name = key.split(".")
    file = tmp_path / "ablation.toml"
    text = (CONFIGS / "debug_model.toml").read_text()
    file.write_text(text.replace(f"[{sec}]\n", f"[{sec}]\n{name} = {toml}\n", 1))
    assert train.main(["--job.config_file", str(file), *_tiny(tiny_pack, tmp_path / "toml")]) == 0
    recipe, cli, from_file = (_losses(tmp_path / d) for d in ("recipe", "cli", "toml"))
    assert cli == from_file and len(cli) == 3
    assert cli != recipe
    resolved = json.loads((tmp_path / "cli" / "run.json").read_text())["resolved"]
    expected = {"false": False}.get(value, value)
    assert resolved[f"model_args.{name}"] == expected


def test_help_shows_the_flavor_of_the_command_and_what_unset_means():
    text = help_text(["--model.flavor", "loom_329m"])
    lines = text.splitlines()
    assert any(ln.startswith("  --model.flavor  str = 'loom_329m'") for ln in lines)
    assert "  --model.num_loops  int or none (none: unset) = 9 (unset: the flavor's value)" in lines
    rms = next(ln for ln in lines if ln.startswith("  --model.ffn_branch_rms"))
    assert "unset by not giving it" in rms and "(one of: none, affine)" in rms


def test_the_last_config_file_is_read_and_recorded(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("[training]\nsteps = 11\n")
    b.write_text("[training]\nsteps = 22\n")
    cfg = load_config(["--job.config_file", str(a), "--job.config_file", str(b)])
    assert (cfg.training.steps, cfg.job.config_file) == (22, str(b))


def test_a_file_naming_another_config_file_is_refused(tmp_path):
    f = tmp_path / "inner.toml"
    f.write_text('[job]\nconfig_file = "x.toml"\n')
    with pytest.raises(ConfigError, match=r"config_file = 'x.toml' in .*inner.toml: a config file"):
        load_config(["--job.config_file", str(f)])


def test_a_flavor_switch_on_the_command_line_is_not_outranked_by_the_file(tmp_path):
    dump = ["--job.dump_folder", str(tmp_path / "run")]  # not ./outputs/debug: it may hold a run
    cfg = load_config([*DEBUG, *dump, "--model.flavor", "loom_329m", "--parallelism.dry_run"])
    args = resolve(cfg, 1).model_args
    assert (args.num_loops, args.dim) == (9, 512)  # the flavor's own H, not the debug preset's
    preset = tmp_path / "p.toml"
    preset.write_text('[model]\nflavor = "debug"\nnum_loops = 2\n')
    with pytest.raises(ConfigError, match=r"model.num_loops = 2 .* written for model loom flavor"):
        load_config(["--job.config_file", str(preset), "--model.flavor", "loom_329m"])
    kept = load_config(
        ["--job.config_file", str(preset), "--model.flavor", "loom_329m", "--model.num_loops", "2"]
    )
    assert kept.model.num_loops == 2


@pytest.mark.parametrize(
    "argv,switch",
    [
        (["--metrics.diag_grad", "true"], "metrics.diag_interval > 0"),
        (["--float8.experts", "true"], "float8.enable = true"),
        (["--eval.downstream_tasks", "arc_easy"], "eval.downstream_interval > 0"),
        (["--checkpoint.interval", "5"], "checkpoint.enable = true"),
        (["--compile.backend", "eager"], "compile.enable = true"),
        (["--profiling.profile_freq", "3"], "profiling.enable_profiling or"),
    ],
)
def test_a_key_whose_feature_is_off_is_refused(argv, switch):
    key = argv[0][2:]
    with pytest.raises(ConfigError, match=rf"{key} is given but has no effect: it needs {switch}"):
        resolve(load_config([*argv, "--parallelism.dry_run"]), 1)  # the schema's switches


def test_from_a_file_or_with_the_switch_turned_off_it_is_named_not_refused(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[compile]\nenable = true\nbackend = "eager"\n')
    cfg = load_config(["--job.config_file", str(f), "--compile.enable", "false"])
    errors, notes = gated_problems(cfg)
    assert errors == [] and notes == [
        f"without effect (compile.enable = true is not set): compile.backend from {f}"
    ]
    errors, _ = gated_problems(
        load_config(["--checkpoint.interval", "5", "--checkpoint.enable", "false"])
    )
    assert errors == []


def test_a_degree_given_at_its_default_is_pinned_under_auto():
    preset = ["--job.config_file", str(CONFIGS / "loom_1p7b.toml"), "--parallelism.dry_run"]
    free = resolve(load_config(preset), 64).dims
    pinned = resolve(load_config([*preset, "--parallelism.dp_replicate", "1"]), 64).dims
    assert pinned.dp_replicate == 1
    assert free.dp_replicate != 1  # else this test would not tell pinned from free


def test_warmup_given_both_ways_in_one_source_is_refused_and_a_later_source_wins(tmp_path):
    with pytest.raises(ConfigError, match="warmup_steps and lr_scheduler.warmup_ratio are both"):
        load_config(["--lr_scheduler.warmup_steps", "9", "--lr_scheduler.warmup_ratio", "0.1"])
    f = tmp_path / "w.toml"
    f.write_text("[training]\nsteps = 100\n[lr_scheduler]\nwarmup_ratio = 0.3\n")
    cfg = load_config(["--job.config_file", str(f), "--lr_scheduler.warmup_steps", "10"])
    assert cfg.lr_scheduler.warmup_ratio == 0.1


def test_a_description_that_looks_like_an_option_or_holds_a_newline(tiny_pack, tmp_path):
    dump = tmp_path / "d"
    assert train.main([*DEBUG, *_tiny(tiny_pack, dump), "--job.description", "-h"]) == 0
    again = load_config(["--job.config_file", str(dump / "config.toml")])
    assert again.job.description == "-h"
    cfg = load_config(["--job.description", "two\nlines"])
    from torchtitan_loom.config import to_toml

    (tmp_path / "c.toml").write_text(to_toml(cfg))
    assert load_config(["--job.config_file", str(tmp_path / "c.toml")]).job.description == (
        "two\nlines"
    )


def test_a_run_folder_s_own_config_toml_with_its_config_file_record_loads(tmp_path):
    """Runs written before config_file became a comment record it as a key: a record, not an
    include (run.json beside it marks the trainer's own file)."""
    (tmp_path / "config.toml").write_text('[job]\nconfig_file = "train_configs/x.toml"\n')
    with pytest.raises(ConfigError, match="a config file cannot name another"):
        load_config(["--job.config_file", str(tmp_path / "config.toml")])
    (tmp_path / "run.json").write_text("{}")
    cfg = load_config(["--job.config_file", str(tmp_path / "config.toml")])
    assert cfg.job.config_file == str(tmp_path / "config.toml")


def test_a_key_whose_feature_is_off_is_answered_before_torch(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.train", "--metrics.diag_grad", "true"]
        + ["--job.dump_folder", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "config error: metrics.diag_grad is given but has no effect: it needs "
        "metrics.diag_interval > 0"
    ]
    assert "importing torch" not in proc.stdout
