"""Format versions of run.json and a checkpoint's meta.json (components/runtime/format_version.py):
written on save; on load a file without one is the legacy format (accepted), a version this code
reads is accepted, any other is refused with one line naming the file, the version found, the
versions read and what to do. The legacy format resuming for real: tests/integration/
test_old_checkpoint.py."""

import json
import os

import pytest
import torch

from tests.unit.test_resume_config import argv as resume_argv
from torchtitan_loom.components.checkpoint import CheckpointError, integrity
from torchtitan_loom.components.checkpoint.resolve import FORMAT_VERSION, FORMATS_READ
from torchtitan_loom.components.runtime import run_folder
from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.trainer import Trainer

CPU = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))


def argv(pack, dump, steps):
    """test_resume_config's small run, ``steps`` long (checkpoints every 2 steps)."""
    return resume_argv(pack, dump, "--training.steps", str(steps))


def edit_json(path, change):
    """Rewrite a JSON file through ``change(dict)``; inside a checkpoint its checksums are redone,
    as the code that wrote such a file would have written them."""
    with open(path) as fh:
        data = json.load(fh)
    change(data)
    with open(path, "w") as fh:
        json.dump(data, fh)
    if os.path.basename(path) == "meta.json":
        integrity.write_checksums(os.path.dirname(path))


@pytest.fixture
def saved_run(tiny_pack, tmp_path):
    """A run folder of this code at step 2 (run.json, step-2/meta.json) and its config, steps 4."""
    first = load_config(argv(tiny_pack, tmp_path, 2))
    trainer = Trainer(first, resolve(first, 1), CPU)
    run_folder.record_launch(first, "first", "running", 0)
    assert trainer.train() == 0
    return tmp_path, argv(tiny_pack, tmp_path, 4)


def test_both_files_are_written_with_their_version(saved_run):
    dump, _ = saved_run
    assert json.loads((dump / "run.json").read_text())["format_version"] == (
        run_folder.RUN_FORMAT_VERSION
    )
    meta = json.loads((dump / "checkpoint" / "step-2" / "meta.json").read_text())
    assert meta["format_version"] == FORMAT_VERSION
    assert FORMAT_VERSION in FORMATS_READ and run_folder.RUN_FORMAT_VERSION in (
        run_folder.RUN_FORMATS_READ
    )


def test_files_without_a_version_are_the_legacy_format_and_resume(saved_run):
    dump, args = saved_run
    edit_json(dump / "run.json", lambda d: d.pop("format_version"))
    edit_json(dump / "checkpoint" / "step-2" / "meta.json", lambda d: d.pop("format_version"))
    cfg = load_config(args)
    trainer = Trainer(cfg, resolve(cfg, 1), CPU)  # neither file refused up front
    trainer.resume()
    assert trainer.resumed_from == 2
    run_folder.record_launch(cfg, "second", "running", 2)  # rewritten in today's format
    assert json.loads((dump / "run.json").read_text())["format_version"] == (
        run_folder.RUN_FORMAT_VERSION
    )


@pytest.mark.parametrize("found", [run_folder.RUN_FORMAT_VERSION + 1, "1", True])
def test_a_run_json_of_another_version_is_refused_in_one_line(saved_run, found):
    dump, args = saved_run
    edit_json(dump / "run.json", lambda d: d.update(format_version=found))
    with pytest.raises(ConfigError) as exc:
        resolve(load_config(args), 1)
    line = str(exc.value)
    assert "\n" not in line
    assert line.startswith(f"{dump / 'run.json'}: format_version {found!r} ")
    assert "reads (1, or none: the legacy format)" in line
    assert "continue this run with the torchtitan_loom that wrote it" in line
    newer = isinstance(found, int) and not isinstance(found, bool)
    assert ("(written by a newer torchtitan_loom)" in line) == newer
    cfg = load_config(args)
    with pytest.raises(run_folder.RunFolderError, match="format_version"):
        run_folder.record_launch(cfg, "second", "running", 2)  # never overwritten either


def test_a_checkpoint_of_a_newer_version_is_refused_up_front_and_at_the_load(saved_run):
    dump, args = saved_run
    cfg = load_config(args)
    resolved = resolve(cfg, 1)  # before the edit: a Trainer built without the config check
    meta = dump / "checkpoint" / "step-2" / "meta.json"
    edit_json(meta, lambda d: d.update(format_version=FORMAT_VERSION + 1))
    assert integrity.verify(str(meta.parent)) is None  # a well-formed checkpoint, only newer
    want = (
        f"{meta}: format_version {FORMAT_VERSION + 1} (written by a newer torchtitan_loom) is not "
        f"one this torchtitan_loom reads (1, or none: the legacy format); resume it with the "
        f"torchtitan_loom that wrote it (or a newer one), or pick a checkpoint of a format this "
        f"one reads with checkpoint.load_step"
    )
    with pytest.raises(ConfigError) as exc:
        resolve(load_config(args), 1)
    assert str(exc.value) == want
    with pytest.raises(CheckpointError) as exc:
        Trainer(cfg, resolved, CPU).resume()
    assert str(exc.value) == want
