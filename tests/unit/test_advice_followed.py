"""Every piece of advice a refusal gives works when followed (issue 45: "raise training.steps" was
itself refused when the run had no checkpoint).

The advice is collected from the package's source: every string (docstrings and argparse help
aside) that tells the user to pass, raise, add or leave out an option, or to run a command, is one
entry of ADVICE, keyed by its file and the option it names. Each entry is followed by a scenario
below: the refusal is provoked, the advice is read from the refusal's own line (the option and the
value it names, or the whole command), applied, and the command must then succeed. An entry that no
scenario here follows names the test that does, or why it cannot be (a new advice fails
test_every_advice_in_the_source_is_followed_or_accounted_for until it is classified).

Small runs (the tiny pack, 2 steps) trained in this process; the tools run in this process too.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from torchtitan_loom import train
from torchtitan_loom.tools import analyze, depth, export, generate

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torchtitan_loom"
# What advice looks like: a verb, then the option (or the key or command) it names.
ADVICE_RE = re.compile(
    r"(?:\bpass|\badd|\braise|\bset|\bneeds|\bwith|\bleave out|\buse a new|\./run_train\.sh) "
    r"(--[a-z][\w.-]*[\w]|training\.steps|job\.dump_folder)"
)
FOLLOWED = "followed here"
LM_EVAL = (
    "not followed here (lm-eval is an optional extra, slow to import); the lm-eval tool tests "
    "run with the advised --holdout-check off / record and --tasks-dir"
)
# (file, option) -> FOLLOWED, or where else it is followed / why it is not.
ADVICE = {
    ("components/runtime/run_folder.py", "training.steps"): FOLLOWED,
    ("components/runtime/run_folder.py", "--checkpoint.enable"): FOLLOWED,
    ("components/runtime/run_folder.py", "--job.overwrite"): FOLLOWED,
    ("components/runtime/run_folder.py", "job.dump_folder"): FOLLOWED,
    ("components/checkpoint/resolve.py", "--job.overwrite"): FOLLOWED,
    ("components/checkpoint/found.py", "--job.config_file"): FOLLOWED,
    ("tools/exit_option.py", "--exit"): FOLLOWED,  # generate --exit (lm_eval --exit shares it)
    ("tools/exit_option.py", "--exit-threshold"): FOLLOWED,
    ("tools/generate.py", "--temperature"): FOLLOWED,
    ("tools/loading.py", "--loops"): FOLLOWED,
    ("tools/out_files.py", "--force"): FOLLOWED,
    ("tools/analyze.py", "--samples"): FOLLOWED,
    ("tools/depth.py", "--tasks-dir"): FOLLOWED,
    ("tools/lm_eval.py", "--holdout-check"): LM_EVAL,
    ("tools/lm_eval.py", "--tasks-dir"): LM_EVAL,
    ("tools/holdout.py", "--holdout-check"): LM_EVAL,
    ("tools/pack.py", "--out"): "not followed: the packer's argparse usage error",
    (
        "components/data/pack_writer.py",
        "--force",
    ): "followed: test_pack_cli.py::test_refuses_to_overwrite_without_force",
    (
        "tools/pack_build.py",
        "--force",
    ): "followed: test_pack_cli.py::test_refuses_to_overwrite_without_force",
    (
        "components/data/pack_tokenizer.py",
        "--tokenizer",
    ): "not followed: needs a pack whose tokenizer file moved",
    (
        "components/data/loaders.py",
        "--holdout-tokens",
    ): "not followed: needs a pack re-packed with a holdout",
    (
        "components/data/synthetic_corpus.py",
        "--out",
    ): "not followed: the corpus CLI's argparse usage error",
    ("config/io_checks.py", "--data.path"): "not followed: needs a pack of longer records",
    (
        "config/io_checks.py",
        "--model.vocab_size",
    ): "not followed: needs a pack of a larger vocabulary",
    (
        "config/section_checks.py",
        "--model.vocab_size",
    ): "not followed: needs a pack of a larger vocabulary",
    ("tools/analyze_run.py", "--data"): "not followed: needs a second pack with a holdout",
    ("tools/depth_run.py", "--data"): "not followed: needs a second pack with a holdout",
    ("tools/hf_export.py", "--format"): "not followed: needs a model without an HF export",
    ("tools/pack_sources.py", "--text-field"): "not followed: needs the HF datasets extra",
}


def _texts(tree: ast.AST):
    """Every string of a module (an f-string with its fields as {}), docstrings and the help,
    description and epilog of argparse calls left out."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            skip.add(id(body[0].value))  # a docstring
        if isinstance(node, ast.keyword) and node.arg in ("help", "description", "epilog"):
            skip |= {id(n) for n in ast.walk(node.value)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.JoinedStr):
            yield "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            skip |= {id(v) for v in node.values}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def advice_in_source() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for text in _texts(ast.parse(path.read_text(encoding="utf-8"))):
            for m in ADVICE_RE.finditer(text):
                found.add((path.relative_to(PACKAGE).as_posix(), m[1]))
    return found


def test_every_advice_in_the_source_is_followed_or_accounted_for():
    found = advice_in_source()
    assert found - ADVICE.keys() == set(), "new advice: follow it below, or say where it is"
    assert ADVICE.keys() - found == set(), "ADVICE names advice the source no longer gives"


# ----- the scenarios


def argv(pack, dump, *extra, steps=2, checkpoints=True) -> list[str]:
    return [
        *("--data.path", str(pack), "--job.dump_folder", str(dump)),
        *("--training.seq_len", "32", "--training.global_batch_size", "4"),
        *("--training.micro_batch_size", "2", "--training.steps", str(steps)),
        *("--eval.interval", "0", "--metrics.enable_tensorboard", "false"),
        *("--checkpoint.enable", str(checkpoints).lower(), "--metrics.log_freq", "1"),
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tiny_pack, tmp_path_factory):
    """Two finished 2-step runs of the tiny pack: one with checkpoints (its last step saved), one
    without; each scenario works on a copy."""
    base = tmp_path_factory.mktemp("advice")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, on in (("saved", True), ("unsaved", False)):
            assert train.main(argv(tiny_pack, base / name, checkpoints=on)) == 0
    finally:
        torch.set_num_threads(threads)
    return base


@pytest.fixture
def copy_of(runs, tmp_path):
    def copy(name: str, to: str | None = None) -> Path:
        return Path(shutil.copytree(runs / name, tmp_path / (to or name)))

    return copy


def refused(main, args, capsys) -> str:
    """The refusal line of ``main(args)`` (exit code 2, one error line)."""
    capsys.readouterr()
    assert main(args) == 2, args
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(lines) == 1, lines
    return lines[0]


def steps_of(dump: Path) -> list[int]:
    rows = (dump / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["step"] for r in rows if '"loss"' in r]


def test_a_finished_run_continues_as_advised(tiny_pack, copy_of, capsys):
    for i, extra in enumerate(([], ["--checkpoint.enable", "false"])):
        dump = copy_of("saved", f"saved{i}")
        line = refused(train.main, argv(tiny_pack, dump, *extra), capsys)
        m = re.search(r"raise training\.steps(?: with (--\S+) (\S+))? to continue", line)
        assert m, line
        follow = argv(tiny_pack, dump, *extra, steps=4) + ([m[1], m[2]] if m[1] else [])
        assert train.main(follow) == 0, line
        assert steps_of(dump) == [1, 2, 3, 4], line  # continued from step 2, not started over


def test_a_finished_run_without_checkpoints_is_not_told_to_raise_steps(tiny_pack, copy_of, capsys):
    """Issue 45's case: its advice is to start over (in place or elsewhere), and both work."""
    dump = copy_of("unsaved")
    line = refused(train.main, argv(tiny_pack, dump, checkpoints=False), capsys)
    assert "training.steps to continue" not in line and "saved no checkpoint" in line, line
    overwrite = re.search(r"pass (--job\.overwrite) (\S+)", line)
    assert overwrite, line
    follow = argv(tiny_pack, dump, overwrite[1], overwrite[2], checkpoints=False)
    assert train.main(follow) == 0 and steps_of(dump) == [1, 2]
    assert "use a new job.dump_folder" in line
    assert train.main(argv(tiny_pack, dump.parent / "new", checkpoints=False)) == 0


def test_damaged_checkpoints_are_replaced_as_advised(tiny_pack, copy_of, capsys):
    dump = copy_of("saved")
    model_file = next((dump / "checkpoint" / "step-2").glob("*.distcp"))
    model_file.write_bytes(b"\0" * model_file.stat().st_size)  # the checksum no longer matches
    line = refused(train.main, argv(tiny_pack, dump, steps=4), capsys)
    m = re.search(r"pass (--job\.overwrite) (\S+) to start a new run", line)
    assert m, line
    assert train.main(argv(tiny_pack, dump, m[1], m[2], steps=4)) == 0
    assert steps_of(dump) == [1, 2, 3, 4]


def test_a_tool_on_a_run_without_checkpoints_gets_the_command_that_gives_it_one(
    tiny_pack, copy_of, capsys
):
    dump = copy_of("unsaved")
    tool = [str(dump), "--prompt", "1+2=", "--max-new-tokens", "3", "--temperature", "0"]
    line = refused(generate.main, tool, capsys)
    command = shlex.split(line.split("./run_train.sh ", 1)[1])
    assert "--checkpoint.enable" in command, line
    # run_train.sh hands its arguments to the trainer unchanged (one process on a CPU).
    assert train.main(command) == 0, command
    assert generate.main(tool) == 0


@pytest.fixture(scope="module")
def saved(runs):
    return str(runs / "saved")


@pytest.mark.parametrize(
    "args, advice, follow",
    [
        # --exit-threshold alone: it names the --exit to add.
        (
            ["--exit-threshold", "0.1"],
            r"needs (--exit) (\w+)",
            lambda args, m: args + [m[1], m[2]],
        ),
        # --exit alone: the example threshold of its criterion.
        (
            ["--exit", "kl"],
            r"needs (--exit-threshold) X.*kl ≥ 0, e\.g\. ([\d.]+)",
            lambda args, m: args + [m[1], m[2]],
        ),
        # --top-k at temperature 0: left out.
        (
            ["--temperature", "0", "--top-k", "5"],
            r"leave them out",
            lambda args, m: ["--temperature", "0"],
        ),
        # ... or a temperature above 0.
        (
            ["--temperature", "0", "--top-k", "5"],
            r"pass (--temperature) above 0",
            lambda args, m: [m[1], "0.8", "--top-k", "5"],
        ),
        # --beyond at the trained depth: the first deeper --loops.
        (
            ["--beyond", "cycle"],
            r"pass (--loops) (\d+)\.\.\d+",
            lambda args, m: args + [m[1], m[2]],
        ),
    ],
)
def test_generate_options_that_would_do_nothing_are_refused_then_work(
    saved, args, advice, follow, capsys
):
    base = [saved, "--prompt", "1+2=", "--max-new-tokens", "3"]
    line = refused(generate.main, base + args, capsys)
    m = re.search(advice, line)
    assert m, line
    assert generate.main(base + follow(args, m)) == 0, line


def test_an_occupied_output_folder_is_replaced_with_force(saved, tmp_path, capsys):
    out = tmp_path / "export"
    assert export.main([saved, str(out)]) == 0
    line = refused(export.main, [saved, str(out)], capsys)
    m = re.search(r"pass (--force) to replace", line)
    assert m, line
    assert export.main([saved, str(out), m[1]]) == 0


def test_analyze_and_depth_options_that_would_do_nothing(saved, tmp_path, capsys):
    small = ["--tokens", "64", "--batch-rows", "2"]
    line = refused(analyze.main, [saved, *small, "--samples", "0", "--layer", "0"], capsys)
    assert "leave them out" in line, line
    assert analyze.main([saved, *small, "--samples", "0", "--out", str(tmp_path / "a")]) == 0
    line = refused(depth.main, [saved, *small, "--tasks", "none", "--limit", "3"], capsys)
    m = re.search(r"leave out (--[\w-]+), (--[\w-]+), (--[\w-]+)", line)
    assert m and "--limit" in m.groups(), line
    assert depth.main([saved, *small, "--tasks", "none", "--out", str(tmp_path / "d")]) == 0
