"""A study knows what each variant changes (issue 42): tools.study refuses, before launching, a
variant that resolves to the configuration of another or of the base, and values a trainer TOML
refuses; tools.compare names the keys each group changes against the reference group (from
run.json's resolved configuration) and warns when two groups logged the same losses."""

from __future__ import annotations

import json
from pathlib import Path

from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.runtime.resolved import resolved_config
from torchtitan_loom.config import load_config, to_toml
from torchtitan_loom.config.fields import overridden_args
from torchtitan_loom.tools import compare as compare_tool
from torchtitan_loom.tools import study as study_tool

PRESET = Path(__file__).resolve().parents[2] / "train_configs" / "debug_model.toml"


def _study(tmp_path, variants: str) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(
        f'[study]\nconfig_file = "{PRESET}"\noverrides = {{ "training.steps" = 4 }}\n'
        f'seeds = [0, 1]\nfolder = "{tmp_path / "out"}"\n{variants}'
    )
    return path


def test_two_variants_that_resolve_alike_are_refused_naming_both(tmp_path, capsys):
    path = _study(
        tmp_path,
        '[variants.A]\n"model.ffn_branch_rms" = "none"\n'
        '[variants.B]\n"model.ffn_branch_rms" = "none"\n"model.num_loops" = 3\n',
    )
    assert study_tool.main([str(path), "--dry-run"]) == exit_codes.BAD_INPUT
    err = capsys.readouterr().err
    assert "[variants.B] resolves to the same configuration as [variants.A]" in err
    assert not (tmp_path / "out").exists()


def test_a_variant_whose_overrides_change_nothing_is_refused_an_empty_one_is_the_base(
    tmp_path, capsys
):
    path = _study(
        tmp_path, '[variants.H3]\n"model.num_loops" = 3\n[variants.H1]\n"model.num_loops" = 1\n'
    )
    assert study_tool.main([str(path), "--dry-run"]) == exit_codes.BAD_INPUT
    assert "[variants.H3] resolves to the same configuration as the base" in capsys.readouterr().err
    path = _study(tmp_path, '[variants.H3]\n[variants.H1]\n"model.num_loops" = 1\n')
    assert study_tool.main([str(path), "--dry-run"]) == exit_codes.OK


def test_values_a_trainer_toml_refuses_are_refused_in_the_study_file(tmp_path, capsys):
    path = _study(
        tmp_path, '[variants.A]\n"model.num_loops" = "none"\n"checkpoint.enable" = "off"\n'
    )
    assert study_tool.main([str(path), "--dry-run"]) == exit_codes.BAD_INPUT
    err = capsys.readouterr().err
    assert "model.num_loops: expected int (leave it out to unset it), got 'none'" in err
    assert "checkpoint.enable: expected bool, got 'off'" in err


def _run(folder: Path, seed: int, losses: list[float], *argv: str) -> Path:
    args = ["--job.config_file", str(PRESET), "--job.dump_folder", str(folder)]
    cfg = load_config([*args, "--training.seed", str(seed), "--training.steps", "2", *argv])
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(to_toml(cfg))
    run = {"status": "finished", "step": 2, "launches": []}
    run["resolved"] = resolved_config(cfg, overridden_args(cfg))
    (folder / "run.json").write_text(json.dumps(run))
    rows = [{"step": s + 1, "loss": v} for s, v in enumerate(losses)]
    rows[-1] |= {"eval_loss_loop_1": losses[-1], "tokens_seen": 8192}
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_compare_names_what_each_group_changes_and_warns_on_identical_losses(tmp_path, capsys):
    runs = [
        _run(tmp_path / "recipe", 0, [3.1, 2.9]),
        _run(tmp_path / "no_norm", 0, [3.1, 2.9], "--model.ffn_branch_rms", "none"),
        _run(tmp_path / "h1", 0, [3.3, 3.0], "--model.num_loops", "1"),
    ]
    assert compare_tool.main([*map(str, runs), "--out", str(tmp_path / "cmp")]) == exit_codes.OK
    out, err = capsys.readouterr()
    assert "model_args.ffn_branch_rms = 'none' (not 'affine')" in out
    assert "model_args.num_loops = 1 (not 3)" in out
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    changes = {g["name"]: g["changes"] for g in doc["groups"]}
    assert {"model_args.ffn_branch_rms": "none"} in changes.values()
    warning = [ln for ln in err.splitlines() if "logged the same loss at every step" in ln]
    assert len(warning) == 1 and "seed 0" in warning[0]
    assert any("logged the same loss" in n for n in doc["notes"])
