"""Any refused or unreadable checkpoint falls back to the previous one with one warning, as a
refused ``.metadata`` does: a pickle planted in a ``.distcp`` entry, a storage length that does
not fit its file, tensor bytes that do not decode (checksums matched in each case). No message
carries terminal colour codes or torch's advice to load with ``weights_only=False``; a checkpoint
asked for by ``load_step`` is refused in one line instead."""

import shutil

import pytest

from tests.unit import planted_checkpoint as planted
from tests.unit.test_run_folder import argv
from torchtitan_loom import train


@pytest.fixture(scope="module")
def pristine(tiny_pack, tmp_path_factory):
    """A run folder with complete step-2 and step-4 (a relaunch with 6 steps resumes it)."""
    dump = tmp_path_factory.mktemp("pristine")
    assert train.main(argv(tiny_pack, dump)) == 0
    return dump


def clean_output(capsys):
    out, err = capsys.readouterr()
    both = out + err
    assert "\x1b" not in both and "weights_only" not in both and "Traceback" not in both, both
    return out, err


@pytest.mark.parametrize(
    "damage, said",
    [
        ("entry_payload", "refused: not plain data (it asks for posix.system)"),
        ("absurd_length", "claims bytes"),
        ("zeroed_tensor", "unreadable ("),
    ],
)
def test_a_damaged_checkpoint_falls_back_to_the_previous_with_one_warning(
    tiny_pack, pristine, tmp_path, capsys, damage, said
):
    dump = tmp_path / "run"
    shutil.copytree(pristine, dump)
    step4, mark = dump / "checkpoint" / "step-4", tmp_path / "CODE_RAN"
    getattr(planted, f"plant_{damage}")(*((step4, mark) if damage == "entry_payload" else (step4,)))
    capsys.readouterr()
    assert train.main(argv(tiny_pack, dump, steps=6)) == 0
    out, err = clean_output(capsys)
    warnings = [line for line in out.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and f"skipping corrupt checkpoint {step4}" in warnings[0], out
    assert said in warnings[0], warnings[0]
    assert f"resumed from {dump / 'checkpoint' / 'step-2'} (step 2" in out, out
    assert not mark.exists() and err == ""


def test_a_damaged_checkpoint_asked_for_by_load_step_is_one_line_exit_2(
    tiny_pack, pristine, tmp_path, capsys
):
    dump = tmp_path / "run"
    shutil.copytree(pristine, dump)
    planted.plant_entry_payload(dump / "checkpoint" / "step-4", tmp_path / "CODE_RAN")
    capsys.readouterr()
    assert train.main(argv(tiny_pack, dump, "--checkpoint.load_step", "4", steps=6)) == 2
    _, err = clean_output(capsys)
    assert len(err.strip().splitlines()) == 1 and err.startswith("checkpoint error: "), err
    assert "step-4" in err and "refused" in err and not (tmp_path / "CODE_RAN").exists()
