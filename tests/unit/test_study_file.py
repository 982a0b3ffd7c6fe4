"""tools.study without training: a bad study file is one ``study error:`` line, exit 2, nothing
launched or written; the plan's order and arguments; finished runs skipped and cut ones resumed,
decided from the run folders' run.json (fake run folders, a fake launcher)."""

import json
from pathlib import Path

import pytest

from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.runtime.run_folder import identity
from torchtitan_loom.config import load_config, to_toml
from torchtitan_loom.tools import study as study_tool
from torchtitan_loom.tools.study_file import override_args, plan, read_study

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "train_configs" / "debug_model.toml"
TINY = '{ "training.steps" = 4, "training.seq_len" = 64 }'


def write_study(tmp_path, body=None, *, seeds="[0, 1]", overrides=TINY, variants=None):
    """A study file in tmp_path (the study folder tmp_path/out); ``body`` replaces it whole."""
    if body is None:
        variants = (
            variants
            or '[variants.H2]\n"model.num_loops" = 2\n[variants.H1]\n"model.num_loops" = 1\n'
        )
        body = (
            f'[study]\nconfig_file = "{PRESET}"\nseeds = {seeds}\nfolder = "{tmp_path / "out"}"\n'
            f"overrides = {overrides}\n{variants}"
        )
    path = tmp_path / "depth.toml"
    path.write_text(body)
    return path


@pytest.fixture
def launches(monkeypatch):
    """The commands the study launches; each "run" finishes (its run.json says so)."""
    calls = []

    def fake(command):
        calls.append(command)
        dump = command[command.index("--job.dump_folder") + 1]
        cfg = load_config(command[1:])
        Path(dump).mkdir(parents=True, exist_ok=True)
        fake_run(Path(dump), cfg, "finished", cfg.training.steps)
        return exit_codes.OK

    monkeypatch.setattr(study_tool, "launch_run", fake)
    monkeypatch.setenv("NGPU", "1")
    return calls


def fake_run(folder, cfg, status, step):
    """What a launch leaves in a run folder: config.toml and run.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(to_toml(cfg))
    run = {"identity": identity(cfg), "status": status, "step": step, "launches": []}
    (folder / "run.json").write_text(json.dumps(run))


BAD = {
    "unknown override key": (
        dict(overrides='{ "training.stepz" = 4 }'),
        "[study] overrides: unknown key 'training.stepz'; did you mean 'training.steps'?",
    ),
    "bad value": (
        dict(overrides='{ "training.steps" = "many" }'),
        "[study] overrides: training.steps: expected int, got 'many'",
    ),
    "unknown variant key": (
        dict(variants='[variants.H3]\n"model.num_loopz" = 3\n'),
        "[variants.H3]: model.num_loopz: not a key of model 'loom'; did you mean 'model.num_loops'?",
    ),
    "empty seeds": (dict(seeds="[]"), "[study] seeds: required, a non-empty list of integers"),
    "duplicated seed": (dict(seeds="[0, 1, 0]"), "[study] seeds: 0 given twice; each seed once"),
    "negative seed": (dict(seeds="[-1]"), "[study] seeds: -1 is not an integer in [0, 2^63 - 1]"),
    "variant name with a slash": (
        dict(variants='[variants."a/b"]\n'),
        "[variants.a/b]: the variant name must be a plain folder name",
    ),
    "reserved variant name": (dict(variants="[variants.compare]\n"), "'compare' is reserved"),
    "no variants": (dict(variants="\n"), "no [variants.<name>] table"),
    "an override of the seed": (
        dict(variants='[variants.H3]\n"training.seed" = 5\n'),
        "[variants.H3]: training.seed is set by the study, not an override; use [study] seeds",
    ),
    "an override of the folder": (
        dict(overrides='{ "job.dump_folder" = "x" }'),
        "[study] overrides: job.dump_folder is set by the study",
    ),
    "a list element with a comma": (
        dict(variants='[variants.H3]\n"eval.downstream_tasks" = ["a,b"]\n'),
        "[variants.H3]: eval.downstream_tasks = ['a,b']: expected a number, string, boolean",
    ),
    "a cross-field problem": (  # validate.resolve, once for both seeds
        dict(variants='[variants.H3]\n"training.global_batch_size" = 5\n'),
        "[variants.H3] seeds 0, 1: training.global_batch_size = 5: must be divisible by",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_study_is_one_line_and_nothing_is_launched(case, tmp_path, launches, capsys):
    kwargs, expected = BAD[case]
    path = write_study(tmp_path, **kwargs)
    assert study_tool.main([str(path)]) == exit_codes.BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("study error: "), err
    assert expected in err[0], err
    assert launches == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "body, expected",
    [
        ("[study]\nseeds = [0]\n[variants.a]\n", "[study] config_file: required"),
        (
            '[study]\nconfig_file = "nope.toml"\nseeds = [0]\n[variants.a]\n',
            "[study] config_file: no such file 'nope.toml' (relative to the current directory",
        ),
        (
            f'[study]\nconfig_file = "{PRESET}"\nseeds = [0]\nsed = 1\n[variants.a]\n',
            "[study] sed: unknown key; did you mean 'seeds'?",
        ),
        (
            f'[study]\nconfig_file = "{PRESET}"\nseeds = [0]\n[variants.a]\n[sweep]\n',
            "unknown table [sweep]; valid: [study], [variants.<name>]",
        ),
        ("[study\n", "not valid TOML"),
    ],
)
def test_a_bad_study_table_is_one_line(body, expected, tmp_path, launches, capsys):
    path = write_study(tmp_path, body)
    assert study_tool.main([str(path), "--dry-run"]) == exit_codes.BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("study error: ") and expected in err[0], err
    assert launches == []


def test_the_plan_is_variant_major_with_the_study_s_arguments(tmp_path):
    study = read_study(str(write_study(tmp_path)))
    assert study.name == "depth"  # the file's stem
    runs, configs = plan(study)
    out = str(tmp_path / "out")
    assert [(r.index, r.variant, r.seed, r.folder) for r in runs] == [
        (1, "H2", 0, f"{out}/H2/seed-0"),
        (2, "H2", 1, f"{out}/H2/seed-1"),
        (3, "H1", 0, f"{out}/H1/seed-0"),
        (4, "H1", 1, f"{out}/H1/seed-1"),
    ]
    head = ["--job.config_file", str(PRESET), "--job.dump_folder", f"{out}/H1/seed-1"]
    # The debug preset saves only its last step: every ceil(4 / 10) = 1 step, before overrides.
    assert runs[3].args == [
        *head,
        *("--training.seed", "1", "--checkpoint.enable", "true", "--checkpoint.interval", "1"),
        *("--training.steps", "4", "--training.seq_len", "64", "--model.num_loops", "1"),
    ]
    cfg = configs[runs[3].folder]
    assert (cfg.model.num_loops, cfg.training.seed, cfg.checkpoint.enable) == (1, 1, True)


def test_an_interval_or_enable_the_study_names_is_kept(tmp_path):
    runs, configs = plan(
        read_study(str(write_study(tmp_path, overrides='{ "checkpoint.interval" = 3 }')))
    )
    assert runs[0].args[6:] == [
        *("--checkpoint.enable", "true", "--checkpoint.interval", "3", "--model.num_loops", "2")
    ]
    assert configs[runs[0].folder].checkpoint.interval == 3
    runs, configs = plan(
        read_study(str(write_study(tmp_path, overrides='{ "checkpoint.enable" = false }')))
    )
    assert runs[0].args[6:] == ["--checkpoint.enable", "false", "--model.num_loops", "2"]
    assert not configs[runs[0].folder].checkpoint.enable


def test_values_are_written_as_the_trainer_s_command_line_reads_them():
    args = override_args(
        {"a.flag": True, "a.n": -1, "a.x": 0.003, "a.l": ["x", "y"], "a.e": [], "a.s": "--x"}
    )
    assert args == ["--a.flag", "true", "--a.n=-1", "--a.x", "0.003", "--a.l", "x,y"] + [
        "--a.e=",
        "--a.s=--x",
    ]
    cfg = load_config(
        override_args(
            {"eval.downstream_tasks": ["a", "b"], "metrics.enable_tensorboard": False}
            | {"optimizer.lr": 0.003, "checkpoint.load_step": -1}
        )
    )
    assert cfg.eval.downstream_tasks == ["a", "b"] and cfg.metrics.enable_tensorboard is False
    assert (cfg.optimizer.lr, cfg.checkpoint.load_step) == (0.003, -1)


def test_finished_runs_are_skipped_and_cut_ones_resumed(tmp_path, launches, capsys):
    path = write_study(tmp_path)
    runs, configs = plan(read_study(str(path)))
    done, cut = runs[0], runs[2]
    fake_run(Path(done.folder), configs[done.folder], "finished", 4)
    fake_run(Path(cut.folder), configs[cut.folder], "stopped", 2)
    assert study_tool.main([str(path), "--dry-run"]) == exit_codes.OK
    out = capsys.readouterr().out
    assert f"run 1 of 4: H2 seed 0 -> {done.folder}: finished at step 4" in out
    assert f"run 3 of 4: H1 seed 0 -> {cut.folder}: partial at step 2 (status stopped; " in out
    assert "no checkpoint: starts over" in out and f"{runs[1].folder}: new" in out
    assert launches == [] and not (tmp_path / "out" / "study.json").exists()

    assert study_tool.main([str(path)]) == exit_codes.OK
    lines = capsys.readouterr().out.splitlines()
    assert [c[c.index("--job.dump_folder") + 1] for c in launches] == [
        runs[1].folder,
        runs[2].folder,
        runs[3].folder,
    ]
    assert launches[1][1:] == cut.args  # the same folder and arguments: the trainer resumes it
    assert f"study: run 1 of 4: H2 seed 0 -> {done.folder}: finished at step 4, skipped" in lines
    assert any(
        ln.startswith(f"study: run 3 of 4: H1 seed 0 -> {cut.folder}: resuming") for ln in lines
    )
    assert sum(ln.startswith("study: run ") and " done in " in ln for ln in lines) == 3
    record = json.loads((tmp_path / "out" / "study.json").read_text())
    assert [(r["variant"], r["seed"], r["folder"]) for r in record["runs"]] == [
        ("H2", 0, "H2/seed-0"),
        ("H2", 1, "H2/seed-1"),
        ("H1", 0, "H1/seed-0"),
        ("H1", 1, "H1/seed-1"),
    ]
    assert record["runs"][0]["wall_s"] is None and record["runs"][1]["wall_s"] >= 0


def test_a_raised_step_count_resumes_a_finished_run(tmp_path):
    runs, configs = plan(read_study(str(write_study(tmp_path))))
    fake_run(Path(runs[0].folder), configs[runs[0].folder], "finished", 3)
    ckpt = Path(runs[0].folder) / "checkpoint" / "step-3"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("")
    (ckpt / ".metadata").write_text("")
    assert study_tool.status_of(runs[0]) == (
        "partial",
        "partial at step 3 (status finished; resumes from checkpoint step 3)",
    )
    assert study_tool.status_of(runs[1]) == ("new", "new")


def test_a_run_folder_trained_with_another_config_is_refused(tmp_path, launches, capsys):
    path = write_study(tmp_path)
    runs, configs = plan(read_study(str(path)))
    other = load_config([*runs[0].args, "--eval.tokens", "999"])
    fake_run(Path(runs[0].folder), other, "finished", 4)
    assert study_tool.main([str(path)]) == exit_codes.BAD_INPUT
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"study error: [variants.H2] seed 0: {runs[0].folder} was trained with")
    assert f"eval.tokens: 999 → {configs[runs[0].folder].eval.tokens}" in err and launches == []


@pytest.mark.parametrize("code, status", [(1, "failed"), (0, "stopped")])
def test_a_failed_or_stopped_run_ends_the_study(code, status, tmp_path, monkeypatch, capsys):
    path = write_study(tmp_path)
    runs, configs = plan(read_study(str(path)))
    calls = []

    def fake(command):
        calls.append(command)
        fake_run(Path(runs[0].folder), configs[runs[0].folder], status, 2)
        return code

    monkeypatch.setattr(study_tool, "launch_run", fake)
    monkeypatch.setenv("NGPU", "1")
    assert study_tool.main([str(path)]) == (exit_codes.FAILED if code else exit_codes.OK)
    captured = capsys.readouterr()
    assert len(calls) == 1
    if code:
        (err,) = captured.err.strip().splitlines()
        assert f"({runs[0].folder}) failed with exit code 1" in err
    else:
        assert f"({runs[0].folder}) stopped after" in captured.out
        assert "rerun the study to resume it" in captured.out
