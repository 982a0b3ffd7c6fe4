"""The docs' refreshable regions and their producers (scripts/refresh_docs.py), without running them.

What a refresh would write is not checked here (the commands take minutes); what is: every marker
is well-formed, every region has a producer and every producer a region, a region shows exactly
the commands its producer runs, the rewrite keeps everything outside the regions, and every
training command the docs show is still a valid config.
"""

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from docs_producers import PRODUCERS  # noqa: E402
from docs_regions import RegionError, all_regions, displayed_commands, doc_files, parse, rewrite  # noqa: E402
from refresh_docs import README_LIMIT, check  # noqa: E402

from torchtitan_loom.config import load_config  # noqa: E402


def test_markers_in_the_tree_are_well_formed_and_known():
    assert check() == []


def test_each_region_shows_the_commands_its_producer_runs():
    for region in all_regions():
        assert displayed_commands(region.body) == list(PRODUCERS[region.name].commands), (
            f"{region.path}: region '{region.name}' shows commands its producer does not run; "
            f"edit scripts/docs_producers.py and rerun python scripts/refresh_docs.py --only {region.name}"
        )


@pytest.mark.parametrize(
    "text, where",
    [
        ("a\n<!-- refresh:x -->\nb\n", "page.md:2: region 'x' is never closed"),
        (
            "<!-- refresh:x -->\n<!-- refresh:y -->\n<!-- /refresh -->\n",
            "page.md:2: region 'y' opens inside region 'x'",
        ),
        ("a\n<!-- /refresh -->\n", "page.md:2: '<!-- /refresh -->' without an opening marker"),
        (
            "see <!-- refresh:x --> here\n<!-- /refresh -->\n",
            "page.md:1: not a well-formed refresh marker",
        ),
        (
            "<!-- refresh:Bad_Name -->\n<!-- /refresh -->\n",
            "page.md:1: not a well-formed refresh marker",
        ),
    ],
)
def test_malformed_markers_are_refused_with_their_line(text, where):
    with pytest.raises(RegionError, match=re.escape(where)):
        parse(text, "page.md")


def test_rewrite_replaces_only_named_regions_and_keeps_indentation():
    text = (
        "intro\n<!-- refresh:a -->\nold a\n<!-- /refresh -->\n- item\n  <!-- refresh:b -->\n  | old | b |\n"
        "  <!-- /refresh -->\n<!-- refresh:c -->\nkept c\n<!-- /refresh -->\nend\n"
    )
    new = rewrite(text, {"a": "new a\n\nsecond", "b": "| new | b |\n| row | 2 |"})
    assert new == (
        "intro\n<!-- refresh:a -->\nnew a\n\nsecond\n<!-- /refresh -->\n- item\n  <!-- refresh:b -->\n"
        "  | new | b |\n  | row | 2 |\n  <!-- /refresh -->\n<!-- refresh:c -->\nkept c\n<!-- /refresh -->\nend\n"
    )
    assert [r.body for r in parse(new)] == ["new a\n\nsecond", "| new | b |\n| row | 2 |", "kept c"]
    assert rewrite(new, {}) == new


def test_displayed_commands_follow_continuations():
    body = '```\n$ ./run_train.sh --a 1 \\\n    --b 2\nout\n$ tool --prompt "x\ny" --n 3\nout\n```'
    assert displayed_commands(body) == [
        "./run_train.sh --a 1 \\\n    --b 2",
        'tool --prompt "x\ny" --n 3',
    ]


def test_a_name_used_twice_is_refused(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- refresh:x -->\n<!-- /refresh -->\n")
    (tmp_path / "docs" / "p.md").write_text("<!-- refresh:x -->\n<!-- /refresh -->\n")
    with pytest.raises(RegionError, match="region 'x' is also in README.md"):
        all_regions(tmp_path)


def test_readme_is_a_front_door_with_the_ci_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) < README_LIMIT
    ci = [
        ln
        for ln in (ROOT / ".ci" / "run").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    suite = [ln for ln in ci if ln.startswith("python -m pytest tests")]
    assert len(suite) == 1, suite  # .ci/run runs the README's suite once, as the README writes it
    command = suite[0].split(" || ")[0]  # .ci/run keeps its exit code to report both streams
    assert f"&& {command}\n```" in readme, "the README's test command must be the one .ci/run runs"
    for page in re.findall(r"\]\((docs/[^)#]+|benchmarks/[^)#]+)", readme):
        assert (ROOT / page).is_file(), page


def _train_commands() -> list[tuple[str, str]]:
    """(page, command) for every training command in a shell block or a '$ ' line of the docs."""
    found = []
    for f in doc_files():
        text = f.read_text(encoding="utf-8")
        for block in re.findall(r"```(?:bash)?\n(.*?)```", text, re.S):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.split("\n"):
                line = line.removeprefix("$ ").split(" #")[0].strip()
                if re.search(
                    r"(^|\s)(\./run_train\.sh|python -m torchtitan_loom\.train)(\s|$)", line
                ):
                    found.append((f.name, line))
    return found


def test_every_documented_training_command_is_a_valid_config():
    commands = _train_commands()
    assert (
        len(commands) >= 10
    )  # the README's tour, parallelism, configuration, float8, the refreshed runs
    for page, line in commands:
        words = shlex.split(line.replace("$NODE", "0"))
        launcher = next(
            i for i, w in enumerate(words) if w in ("./run_train.sh", "torchtitan_loom.train")
        )
        args = [w for w in words[launcher + 1 :] if w not in ("--help", "…")]  # "…": the rest
        try:
            load_config(args)
        except Exception as exc:  # the message names the key
            pytest.fail(f"{page}: `{line}` is not a valid config: {exc}")


def test_every_documented_command_runs_after_the_readmes_first_command(tmp_path, monkeypatch):
    """Issue 35: the README's first command leaves a finished debug run in ./outputs/debug; every
    other training command the docs show, typed next in the same folder, must pass the config
    checks that look at its run folder (the data of a corpus the reader has not packed, or a GPU
    this machine lacks, are not this check's)."""
    from torchtitan_loom.components.checkpoint import names
    from torchtitan_loom.components.runtime import run_folder
    from torchtitan_loom.config import ConfigError
    from torchtitan_loom.config.validate import resolve

    monkeypatch.chdir(tmp_path)
    first = load_config(["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")])
    os.makedirs(first.job.dump_folder)
    finished = {"identity": run_folder.identity(first), "status": "finished", "step": 180}
    (tmp_path / first.job.dump_folder / names.RUN_JSON).write_text(json.dumps(finished))
    checked = 0
    for page, line in _train_commands():
        words = shlex.split(line.replace("$NODE", "0"))
        env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        launcher = next(
            i for i, w in enumerate(words) if w in ("./run_train.sh", "torchtitan_loom.train")
        )
        args = [w for w in words[launcher + 1 :] if w != "…"]
        if "--help" in args or (page == "README.md" and args == []):  # the first command itself
            continue
        args = [str(ROOT / a) if a.startswith("train_configs/") else a for a in args]
        if "--job.config_file" not in args and words[launcher] == "./run_train.sh":
            args = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), *args]
        world = int(env.get("NGPU", "1")) * int(env.get("NNODES", "1").split(":")[0])
        try:
            resolve(load_config(args), world)
        except ConfigError as exc:
            folder = [ln for ln in str(exc).splitlines() if "job.dump_folder" in ln]
            assert not folder, f"{page}: `{line}` after the README's first command: {folder}"
        checked += 1
    assert checked >= 10
