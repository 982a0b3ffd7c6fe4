"""tools.export answers what needs no checkpoint before torch is imported (tools/export_cli.py):
an occupied OUT without --force, a bad option, --help; with --force, or an empty OUT, it goes on
to the export (torch imported). Checked in a fresh interpreter, by whether torch got imported."""

import subprocess
import sys

RUN = """
import runpy, sys
sys.argv = ["export", *sys.argv[1:]]
try:
    runpy.run_module("torchtitan_loom.tools.export", run_name="__main__")
    code = 0
except SystemExit as exc:
    code = exc.code
print("RESULT", code, "torch" in sys.modules)
"""


def _export(*args: str) -> tuple[str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=120
    )
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return result, proc.stderr


def test_an_occupied_out_is_refused_before_torch(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result, err = _export(str(tmp_path / "no_ckpt"), str(out))
    assert result == "RESULT 2 False", (result, err)
    assert err.strip() == (
        f"export error: {out} already holds notes.txt; pass --force to replace what the tool "
        "wrote there, or choose a new folder"
    )
    assert (out / "notes.txt").read_text() == "mine"
    result, err = _export(str(tmp_path / "no_ckpt"), str(out / "notes.txt"))
    assert result == "RESULT 2 False" and "exists and is not a directory" in err, (result, err)


def test_a_bad_option_is_refused_before_torch(tmp_path):
    result, err = _export("ckpt", str(tmp_path / "out"), "--dtype", "fp8")
    assert result == "RESULT 2 False" and "invalid choice: 'fp8'" in err, (result, err)


def test_an_empty_out_or_force_goes_on_to_the_export(tmp_path):
    """Past the early answers the checkpoint is read (torch imported): a missing one is refused
    there, by the full tool."""
    for extra in ((), ("--force",)):
        result, err = _export(str(tmp_path / "no_ckpt"), str(tmp_path / "out"), *extra)
        assert result == "RESULT 2 True", (extra, result, err)
        assert err.startswith("export error:") and "no_ckpt" in err, err
