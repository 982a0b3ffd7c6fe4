"""Downstream scores during training (eval.downstream_*): a local lm-eval task is scored on the
live model during a CPU run, logged as downstream/<task>/<metric> with a start and a done line,
and equals tools.lm_eval on the checkpoint of that step; a stop signal during the scoring drops
it, saves and exits as during eval; bad settings are config errors."""

import json
import signal

import pytest

pytest.importorskip("lm_eval")

from conftest import TASKS_DIR

from tests.unit.test_checkpoint import make_trainer
from tests.unit.test_signals import signal_on_forward
from torchtitan_loom.components.checkpoint import tree
from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.tools import lm_eval as eval_tool

TASK = "loom_tiny_mc"
# Capacity off in training too, as tools.lm_eval scores: a question's score then depends on its
# own tokens only, so the live model and the checkpoint must give the same numbers.
SCORING = (
    "--eval.downstream_interval",
    "4",
    "--eval.downstream_tasks",
    TASK,
    "--eval.downstream_tasks_dir",
    TASKS_DIR,
    "--eval.downstream_only_tasks_dir",
    "true",
    "--eval.downstream_batch_size",
    "4",
    "--model.capacity_factor",
    "0",
    "--optimizer.lr",
    "3e-3",
    "--spike_guard.enable",
    "false",
)


def test_scored_during_training_equals_lm_eval_on_the_checkpoint(tiny_pack, tmp_path, capsys):
    dump = tmp_path / "run"
    t = make_trainer(
        tiny_pack,
        dump,
        "--training.steps",
        "8",
        "--checkpoint.interval",
        "4",
        "--checkpoint.keep_latest_k",
        "0",
        *SCORING,
    )
    assert t.train() == 0
    out = capsys.readouterr().out
    assert f"downstream at step 4: {TASK} ..." in out and f"downstream at step 8: {TASK} ..." in out
    assert out.count("downstream done in ") == 2 and f"{TASK}/acc " in out
    rows = {
        r["step"]: r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())
    }
    scored = {
        s: {k: v for k, v in r.items() if k.startswith("downstream/")} for s, r in rows.items()
    }
    assert set(scored[4]) == {f"downstream/{TASK}/acc", f"downstream/{TASK}/acc_norm"}
    assert not scored[3] and set(scored[8]) == set(scored[4])

    code = eval_tool.main(
        [
            str(dump / "checkpoint" / "step-4"),
            "--tasks",
            TASK,
            "--tasks-dir",
            TASKS_DIR,
            "--only-tasks-dir",
            "--holdout-check",
            "off",
            "--out",
            str(tmp_path / "eval"),
        ]
    )
    assert code == 0
    results = json.load(open(next((tmp_path / "eval").glob("*/results.json"))))["results"][TASK]
    assert scored[4][f"downstream/{TASK}/acc"] == results["acc,none"]
    assert scored[4][f"downstream/{TASK}/acc_norm"] == results["acc_norm,none"]


def test_stop_signal_while_scoring_drops_the_scores_saves_and_exits_0(tiny_pack, tmp_path, capfd):
    dump = tmp_path / "run"
    t = make_trainer(
        tiny_pack,
        dump,
        "--training.steps",
        "6",
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_latest_k",
        "0",
        *SCORING[:1],
        "2",
        *SCORING[2:],
    )
    signal_on_forward(t, signal.SIGTERM, step=2, call=1, training=False)  # the first scoring batch
    assert t.train() == 0 and t.state.step == 2
    out = capfd.readouterr().out
    assert "downstream at step 2: stopped by a signal" in out and "stopped after step 2" in out
    rows = [json.loads(r) for r in (dump / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and not any(k.startswith("downstream/") for k in rows[-1])
    assert tree.scan(str(dump / "checkpoint")).newest().step == 2


def test_bad_downstream_settings_are_config_errors(tiny_pack, tmp_path):
    base = [
        "--data.path",
        str(tiny_pack),
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "32",
    ]
    cases = [
        (
            ["--eval.downstream_interval", "5"],
            "eval.downstream_interval > 0 needs eval.downstream_tasks",
        ),
        (["--eval.downstream_interval", "-1"], "eval.downstream_interval = -1: must be ≥ 0"),
        (
            [
                "--eval.downstream_interval",
                "5",
                "--eval.downstream_tasks",
                "loom_tiny_mcq",
                "--eval.downstream_tasks_dir",
                TASKS_DIR,
                "--eval.downstream_only_tasks_dir",
                "true",
            ],
            "eval.downstream_tasks: lm-eval knows no task 'loom_tiny_mcq'; did you mean loom_tiny_mc",
        ),
        (
            [
                "--eval.downstream_interval",
                "5",
                "--eval.downstream_tasks",
                TASK,
                "--eval.downstream_tasks_dir",
                str(tmp_path / "nope"),
            ],
            "not a directory",
        ),
        (["--metrics.diag_interval", "-2"], "metrics.diag_interval = -2: must be ≥ 0"),
    ]
    for extra, expected in cases:
        with pytest.raises(ConfigError, match=None) as err:
            resolve(load_config(base + extra), 1)
        assert expected in str(err.value), str(err.value)
