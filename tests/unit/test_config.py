"""Config system: TOML + CLI overrides + precedence, --help, and one-line errors with exit code 2."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_loom.config import ConfigError, help_text, load_config, to_toml
from torchtitan_loom.config.manager import section_fields, section_types
from torchtitan_loom.config.validate import resolve

ROOT = Path(__file__).resolve().parents[2]


def write_toml(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.5\n")
    cfg = load_config(["--job.config_file", path, "--training.steps", "9", "--optimizer.lr=0.25"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.optimizer.lr == 0.25  # --k=v form
    assert cfg.training.micro_batch_size == 8  # default kept
    assert cfg.job.config_file == path


def test_booleans_lists_and_none():
    cfg = load_config(
        [
            "--spike_guard.enable",
            "false",
            "--metrics.enable_tensorboard",
            "--model.num_loops",
            "9",
            "--model.cycle_residual_scale=false",
        ]
    )
    assert cfg.spike_guard.enable is False
    assert cfg.metrics.enable_tensorboard is True
    assert cfg.model.num_loops == 9 and cfg.model.cycle_residual_scale is False
    cfg = load_config(["--model.num_loops", "none"])
    assert cfg.model.num_loops is None


def test_seed_launcher_ablation_switches_reachable(tmp_path):
    # CYCLE_RESIDUAL_SCALE, EMBED_INJECT_MODE, FFN_BRANCH_RMS, BP_K, H, λ, β from TOML and CLI.
    toml = (
        '[model]\ncycle_residual_scale = false\nembed_inject_mode = "none"\nffn_branch_rms = "none"\n'
        "num_loops = 6\ncycle_scale_lambda = 0.25\nlooping_residual_beta = 0.7\n[training]\nbp_segment_len = 2\n"
    )
    cfg = load_config(["--job.config_file", write_toml(tmp_path, toml)])
    args = resolve(cfg, 1).model_args
    assert (args.cycle_residual_scale, args.embed_inject_mode, args.ffn_branch_rms) == (
        False,
        "none",
        "none",
    )
    assert (args.num_loops, args.cycle_scale_lambda, args.looping_residual_beta) == (6, 0.25, 0.7)
    assert cfg.training.bp_segment_len == 2
    cfg = load_config(
        [
            "--model.embed_inject_mode",
            "loop_start_mix_soft",
            "--model.num_loops",
            "12",
            "--training.bp_segment_len",
            "0",
            "--model.cycle_scale_lambda",
            "0.5",
        ]
    )
    args = resolve(cfg, 1).model_args
    assert args.num_loops == 12 and args.embed_inject_mode == "loop_start_mix_soft"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.stepz", "3"], "unknown key 'training.stepz'; did you mean 'training.steps'?"),
        (["--trainin.steps", "3"], "unknown section 'trainin'; did you mean 'training'?"),
        (["--training.steps", "abc"], "training.steps: expected int, got 'abc'"),
        (["--training.steps", "true"], "training.steps: expected int, got 'true'"),
        (["--spike_guard.enable", "maybe"], "spike_guard.enable: expected bool, got 'maybe'"),
        (
            ["--model.attn_backend", "magic"],
            "model.attn_backend: 'magic' is not one of auto, sdpa, flex, flash_attn",
        ),
        (
            ["--job.config_file", "/nonexistent.toml"],
            "job.config_file: no such file '/nonexistent.toml'",
        ),
        (["positional"], "unexpected argument 'positional'"),
    ],
)
def test_load_errors_name_the_key(argv, expected):
    with pytest.raises(ConfigError) as exc:
        load_config(argv)
    assert str(exc.value).startswith(expected)
    assert "\n" not in str(exc.value)


def test_toml_type_and_key_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"^training.steps: expected int, got '10'$"):
        load_config(["--job.config_file", write_toml(tmp_path, '[training]\nsteps = "10"\n')])
    with pytest.raises(ConfigError, match="unknown key 'optimizer.learning_rate'"):
        load_config(
            ["--job.config_file", write_toml(tmp_path, "[optimizer]\nlearning_rate = 1.0\n")]
        )
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(["--job.config_file", write_toml(tmp_path, "[training\n")])


@pytest.mark.parametrize(
    "argv, world, expected",
    [
        (
            ["--training.global_batch_size", "12", "--training.micro_batch_size", "8"],
            1,
            "training.global_batch_size = 12: must be divisible by data-parallel ranks × micro_batch_size = 1 × 8",
        ),
        (
            ["--training.global_batch_size", "16", "--training.micro_batch_size", "8"],
            4,
            "training.global_batch_size = 16: must be divisible by data-parallel ranks × micro_batch_size = 4 × 8",
        ),
        (["--training.bp_segment_len", "-1"], 1, "training.bp_segment_len = -1: must be ≥ 0"),
        (
            ["--training.seq_len", "4096"],
            1,
            "training.seq_len = 4096: the model flavor 'debug' supports at most",
        ),
        (
            ["--data.path", "/definitely/missing"],
            1,
            "data.path: no such directory '/definitely/missing'",
        ),
        (
            ["--model.flavor", "huge"],
            1,
            "model.flavor: unknown flavor 'huge' of 'loom'; valid: debug",
        ),
        (["--parallelism.ep", "2"], 1, "parallelism.ep = 2: must divide dp_shard = 1"),
        (["--parallelism.tp", "2"], 1, "parallelism.tp = 2: tensor parallel is not supported"),
        (
            ["--float8.enable", "--training.device", "cpu"],
            1,
            "float8.enable = true on CPU needs float8.emulate = true",
        ),
        (
            ["--checkpoint.enable", "--checkpoint.interval", "0"],
            1,
            "checkpoint.interval = 0: must be ≥ 1",
        ),
    ],
)
def test_validation_errors(argv, world, expected):
    with pytest.raises(ConfigError) as exc:
        resolve(load_config(argv), world)
    assert str(exc.value).startswith(expected), str(exc.value)


def test_model_args_errors_surface_as_config_errors():
    with pytest.raises(ConfigError, match=r"^model: .*num_loops"):
        resolve(load_config(["--model.num_loops", "0"]), 1)


def test_seq_len_checked_against_pack(tiny_pack, tmp_path):
    # A real pack: since issue #11 validation opens the whole pack (a metadata.json alone is refused).
    resolve(load_config(["--data.path", str(tiny_pack), "--training.seq_len", "32"]), 1)
    with pytest.raises(ConfigError, match=r"records of at most 33 tokens, so seq_len must be ≤ 32"):
        resolve(load_config(["--data.path", str(tiny_pack), "--training.seq_len", "33"]), 1)
    # The record length is seq_len + 1 (inputs and shifted targets): the message says how to pack.
    with pytest.raises(ConfigError, match=r"is written with tools\.pack --seq-len 41\)$"):
        resolve(load_config(["--data.path", str(tiny_pack), "--training.seq_len", "40"]), 1)


def test_every_field_documented_and_in_help():
    text = help_text()
    for sec, cls in section_types().items():
        assert f"[{sec}]" in text
        for key, (_, f) in section_fields(cls).items():
            assert f.metadata.get("doc"), f"{sec}.{key} has no doc"
            assert f"--{sec}.{key}" in text


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(
        ["--training.steps", "11", "--model.num_loops", "4", "--job.description", 'a "quoted" run']
    )
    path = write_toml(tmp_path, to_toml(cfg))
    again = load_config(["--job.config_file", path])
    again.job.config_file = cfg.job.config_file
    assert again == cfg


def test_shipped_configs_load_and_validate():
    # The dry run reads no data, so the presets validate without their data folders (issue #11).
    for name in ("debug_model", "loom_329m", "loom_1p7b"):
        cfg = load_config(
            [
                "--job.config_file",
                str(ROOT / "train_configs" / f"{name}.toml"),
                "--parallelism.dry_run",
                "true",
            ]
        )
        args = resolve(cfg, 1 if name == "debug_model" else 8).model_args
        assert args.num_loops == (3 if name == "debug_model" else 9)
    # Training them on the bundled corpus (records of 257 tokens) at seq_len 1023 is refused.
    cfg = load_config(
        ["--job.config_file", str(ROOT / "train_configs" / "loom_329m.toml"), "--data.path", ""]
    )
    with pytest.raises(
        ConfigError, match=r"training.seq_len = 1023: the bundled corpus .* must be ≤ 256"
    ):
        resolve(cfg, 8)


def test_gpu_presets_compile_and_debug_stays_eager():
    # TorchTitan's GPU configs compile; the CPU debug preset does not (a cold compile costs minutes there).
    for name, compiled in (
        ("loom_329m", True),
        ("loom_1p7b", True),
        ("loom_1p7b_float8", True),
        ("debug_model", False),
    ):
        cfg = load_config(["--job.config_file", str(ROOT / "train_configs" / f"{name}.toml")])
        assert cfg.compile.enable is compiled, name


def test_cli_exit_code_2_and_one_line_per_error():
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.train", "--training.stepz", "3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "config error: unknown key 'training.stepz'; did you mean 'training.steps'?"
    ]
    # Answered before torch is imported (config/early.py): nothing about importing is said.
    assert proc.stdout == ""
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.train", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0 and "--training.bp_segment_len" in proc.stdout
    assert proc.stdout.startswith("usage: ")


def test_the_config_is_read_and_checked_without_importing_torch():
    """Issue 35: a typo is answered before torch is imported. load_config (TOML, CLI, keys, types,
    choices, the model's flavors), --help's text and the early answer import no torch module."""
    code = (
        "import sys\n"
        "from torchtitan_loom.config import ConfigError, help_text, load_config\n"
        f"load_config(['--job.config_file', {str(ROOT / 'train_configs' / 'loom_1p7b.toml')!r}])\n"
        "help_text(['--model.flavor', 'debug'])\n"
        "try:\n    load_config(['--trainig.steps', '3'])\nexcept ConfigError:\n    pass\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_model_keys_are_generated_from_the_model_args_and_choices_come_from_their_modules():
    from torchtitan_loom.components.optim import lr_scheduler, optimizer
    from torchtitan_loom.config.manager import section_fields
    from torchtitan_loom.config.schema import ActivationCheckpoint, LRScheduler, model_section
    from torchtitan_loom.config.schema import Optimizer as OptimizerSection
    from torchtitan_loom.distributed import activation_checkpoint
    from torchtitan_loom.models.loom import args as loom_args

    Model = model_section("loom")
    model_keys = set(section_fields(Model)) - {"name", "flavor"}
    assert model_keys == {f.name for f in dataclasses.fields(loom_args.LoomModelArgs)} - {
        "init_seed"
    }
    fields = section_fields(Model)
    assert fields["attn_backend"][1].metadata["choices"] is loom_args.ATTN_BACKENDS
    assert fields["moe_impl"][1].metadata["choices"] is loom_args.MOE_IMPLS
    assert "Loops H" in fields["num_loops"][1].metadata["doc"]  # the args field's own docstring
    assert (
        section_fields(ActivationCheckpoint)["mode"][1].metadata["choices"]
        is activation_checkpoint.AC_MODES
    )
    assert section_fields(LRScheduler)["kind"][1].metadata["choices"] is lr_scheduler.VALID_KINDS
    assert (
        section_fields(OptimizerSection)["implementation"][1].metadata["choices"]
        is optimizer.VALID_IMPLEMENTATIONS
    )


def test_preset_comments_quote_no_duration():
    """A run time belongs to the README's measured regions (scripts/refresh_docs.py); a figure in a
    preset's comment goes stale unnoticed (the debug preset said ~2 minutes, 4 were measured)."""
    import re

    for path in (Path(__file__).parents[2] / "train_configs").glob("*.toml"):
        comments = [ln for ln in open(path) if ln.lstrip().startswith("#")]
        stale = [ln for ln in comments if re.search(r"\d\s*(minutes?|min|hours?|seconds?)\b", ln)]
        assert not stale, (path, stale)


def test_a_flag_without_its_value_says_so():
    for argv in (["--training.steps"], ["--training.steps", "--eval.interval", "3"]):
        with pytest.raises(ConfigError) as exc:
            load_config(argv)
        assert str(exc.value) == "--training.steps is given without a value; it takes int"
    assert load_config(["--checkpoint.enable"]).checkpoint.enable is True  # a bool flag alone


def test_help_shows_the_values_the_command_would_run_with_and_names_their_file():
    from torchtitan_loom.config import help_text

    preset = str(ROOT / "train_configs" / "debug_model.toml")
    text = help_text(["--job.config_file", preset, "--training.steps", "7"])
    assert f"Values shown: {preset} over the schema's defaults, with the command line's" in text
    assert "--job.dump_folder  str = './outputs/debug'" in text  # the preset's, not ./outputs
    assert "--training.steps  int = 7" in text
    bare = help_text()
    assert "Values shown: the schema's defaults (no config file)." in bare
    assert "--training.steps  int = 300" in bare


def test_python_m_train_without_a_config_runs_the_preset_run_train_sh_runs(tmp_path):
    """Issue 35: `python -m torchtitan_loom.train` without a config trained the schema's defaults
    (300 steps into ./outputs) where ./run_train.sh trains the debug preset; both now take the
    preset from one place (config/early.py), whatever the current directory."""
    import subprocess
    import sys

    from torchtitan_loom.config.early import DEFAULT_PRESET, with_default_preset

    assert DEFAULT_PRESET == str(ROOT / "train_configs" / "debug_model.toml")
    assert with_default_preset(["--training.steps", "3"]) == [
        "--job.config_file",
        DEFAULT_PRESET,
        "--training.steps",
        "3",
    ]
    named = ["--job.config_file=other.toml"]
    assert with_default_preset(named) == named

    def help_of(cmd):
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120).stdout

    module = help_of([sys.executable, "-m", "torchtitan_loom.train", "--help"])
    script = help_of([str(ROOT / "run_train.sh"), "--help"])
    assert f"Values shown: {DEFAULT_PRESET} over the schema's defaults." in module
    assert module == script
