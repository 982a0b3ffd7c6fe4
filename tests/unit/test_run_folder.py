"""The run folder (issue #11): run lock (live and stale), relaunch into a different, finished or
non-resumable run refused, job.overwrite, run_id and launch marker in metrics.jsonl, load_step of
an older step moving the newer checkpoints to abandoned/."""

import json
import socket
import subprocess
import sys

from torchtitan_loom import train
from torchtitan_loom.components.checkpoint import names, tree
from torchtitan_loom.components.runtime import run_folder
from torchtitan_loom.components.runtime.resolved import flat_sections
from torchtitan_loom.config import load_config


def argv(pack, dump, *extra, steps=4):
    return [
        "--data.path",
        str(pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--training.steps",
        str(steps),
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--eval.interval",
        "0",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
        *extra,
    ]


def rows(dump):
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def write_lock(dump, pid):
    dump.mkdir(parents=True, exist_ok=True)
    (dump / run_folder.LOCK).write_text(
        json.dumps(
            {"host": socket.gethostname(), "pid": pid, "run_id": "other", "started": "earlier"}
        )
    )


def test_a_second_live_run_is_refused(tiny_pack, tmp_path, capsys):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path, other.pid)
        assert train.main(argv(tiny_pack, tmp_path)) == 2
        err = capsys.readouterr().err
        assert (
            f"in use by a live run: pid {other.pid} on this host" in err
            and str(tmp_path / "RUN.lock") in err
        )
        assert not (tmp_path / "metrics.jsonl").exists()
        assert json.loads((tmp_path / run_folder.LOCK).read_text())["pid"] == other.pid  # untouched
    finally:
        other.kill()
        other.wait()


def test_a_stale_lock_is_taken_over_and_released(tiny_pack, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(tmp_path, dead.pid)
    assert train.main(argv(tiny_pack, tmp_path)) == 0
    assert f"stale run lock {tmp_path / 'RUN.lock'} (pid {dead.pid}" in capsys.readouterr().out
    assert not (tmp_path / run_folder.LOCK).exists()


def test_relaunch_rules_and_launch_markers(tiny_pack, tmp_path, capsys):
    assert train.main(argv(tiny_pack, tmp_path)) == 0
    run = run_folder.read_run(str(tmp_path))
    assert run["status"] == "finished" and run["step"] == 4
    for extra, expected in (
        (["--training.seed", "1"], "holds a different run (training.seed: 0 → 1)"),
        ([], "holds a finished run (step 4 of training.steps = 4)"),
        (["--checkpoint.enable", "false"], "holds a finished run"),
    ):
        capsys.readouterr()
        assert train.main(argv(tiny_pack, tmp_path, *extra)) == 2, extra
        err = capsys.readouterr().err
        assert expected in err and "--job.overwrite" in err, err
    # Raising training.steps continues the run: a new run_id, and its first row marks the restart.
    assert train.main(argv(tiny_pack, tmp_path, steps=6)) == 0
    r = rows(tmp_path)
    assert [x["step"] for x in r] == [1, 2, 3, 4, 5, 6]
    first, second = r[0]["run_id"], r[4]["run_id"]
    assert first != second and {x["run_id"] for x in r[:4]} == {first} and r[5]["run_id"] == second
    assert r[0]["launch"] == {"resumed_from_step": None} and r[4]["launch"] == {
        "resumed_from_step": 4
    }
    assert "launch" not in r[1] and "launch" not in r[5]
    assert [x["run_id"] for x in run_folder.read_run(str(tmp_path))["launches"]] == [first, second]


def test_checkpoints_off_cannot_continue_a_run(tiny_pack, tmp_path, capsys):
    full = argv(tiny_pack, tmp_path, steps=6)
    base = full[: full.index("--checkpoint.enable")]  # no checkpoint key: each would be refused
    assert train.main(base) == 0
    capsys.readouterr()
    assert train.main(base) == 2  # the same command again: finished
    assert "holds a finished run" in capsys.readouterr().err
    longer = [
        ("8" if a == "6" else a) for a in base
    ]  # more steps: would start over and mix two histories
    assert train.main(longer) == 2
    assert "checkpoint.enable = false cannot continue" in capsys.readouterr().err
    assert len(rows(tmp_path)) == 6


def test_overwrite_moves_the_old_run_aside(tiny_pack, tmp_path, capsys):
    assert train.main(argv(tiny_pack, tmp_path)) == 0
    old_id = run_folder.read_run(str(tmp_path))["run_id"]
    capsys.readouterr()
    assert (
        train.main(argv(tiny_pack, tmp_path, "--training.seed", "1", "--job.overwrite", "true"))
        == 0
    )
    old = tmp_path / f"replaced-{old_id}"
    moved = [ln for ln in capsys.readouterr().out.splitlines() if "job.overwrite: moved" in ln]
    assert moved == [
        f"[torchtitan_loom] job.overwrite: moved the previous run's run.json, config.toml, "
        f"metrics.jsonl, checkpoint to {old}"
    ], moved
    assert len(rows(old)) == 4 and (old / "checkpoint" / "step-4" / tree.MARKER).exists()
    r = rows(tmp_path)
    assert [x["step"] for x in r] == [1, 2, 3, 4] and r[0]["launch"] == {"resumed_from_step": None}
    assert run_folder.read_run(str(tmp_path))["identity"]["training.seed"] == 1


def test_load_step_moves_newer_checkpoints_to_abandoned(tiny_pack, tmp_path, capsys):
    assert train.main(argv(tiny_pack, tmp_path, steps=6)) == 0
    root = tmp_path / "checkpoint"
    before = {s: (root / f"step-{s}" / "__0_0.distcp").read_bytes() for s in (4, 6)}
    capsys.readouterr()
    assert train.main(argv(tiny_pack, tmp_path, "--checkpoint.load_step", "2", steps=6)) == 0
    assert "moved the checkpoints newer than step 2 (step-4, step-6)" in capsys.readouterr().out
    for s in (4, 6):  # the first history is kept intact, the new one is saved next to it
        kept = root / tree.ABANDONED / f"step-{s}"
        assert (kept / "__0_0.distcp").read_bytes() == before[s] and (kept / tree.MARKER).exists()
        assert (root / f"step-{s}" / tree.MARKER).exists()
    r = rows(tmp_path)
    assert [x["step"] for x in r] == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6]
    assert r[6]["launch"] == {"resumed_from_step": 2} and r[6]["run_id"] != r[5]["run_id"]


def test_a_live_run_is_named_first_whatever_else_the_relaunch_gets_wrong(
    tiny_pack, tmp_path, capsys
):
    """Issue 35: relaunching over a live run with other settings (which the finished-run or
    other-run rules would refuse) names the live run, alone, before anything else."""
    assert train.main(argv(tiny_pack, tmp_path)) == 0
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path, other.pid)
        capsys.readouterr()
        assert train.main(argv(tiny_pack, tmp_path, "--checkpoint.enable", "false")) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and f"in use by a live run: pid {other.pid} on this host" in err[0], (
            err
        )
    finally:
        other.kill()
        other.wait()


def test_a_finished_run_is_refused_before_torch_is_imported(tmp_path):
    """The run folder's refusal needs only its run.json: it comes in the time a typo's does."""
    from torchtitan_loom.config.manager import load_config

    args = ["--job.dump_folder", str(tmp_path), "--training.steps", "4"]
    finished = {"identity": run_folder.identity(load_config(args)), "status": "finished", "step": 4}
    (tmp_path / names.RUN_JSON).write_text(json.dumps(finished))
    code = (
        "import sys\nfrom torchtitan_loom.config.early import answer_early\n"
        f"try:\n    answer_early({args!r})\nexcept SystemExit as e:\n"
        "    print(e.code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"], done
    assert "holds a finished run (step 4 of training.steps = 4)" in done.stderr
    assert "it saved no checkpoint, so it cannot be continued" in done.stderr  # none on disk
    # A different run waits for the checks after torch, so that its other problems come with it.
    from torchtitan_loom.config.early import answer_early

    answer_early([*args, "--training.seed", "1"])  # returns: nothing to say before torch


def test_an_identity_key_the_run_did_not_record_reads_as_the_schema_default(tmp_path):
    """A run recorded before an identity key existed trained with that key's default: a launch at
    the default continues it, a launch at another value is a different run, with the default named
    as the run's value. Every non-model key of the identity, one at a time."""
    base = ["--job.dump_folder", str(tmp_path), "--checkpoint.enable"]
    cfg = load_config(base)
    flat = flat_sections(run_folder.identity(cfg))
    other = {  # a non-default value per key, where the test can make one without data on disk
        "training.seed": "7",
        "training.sample_depth_min": "1",
        "optimizer.name": "Lion",
    }
    keys = [k for k in flat if not k.startswith("model.")]
    assert set(other) <= set(keys), keys
    for key in keys:
        recorded = {k: v for k, v in run_folder.identity(cfg).items() if k != key}
        run = {"format_version": run_folder.RUN_FORMAT_VERSION, "identity": recorded}
        (tmp_path / names.RUN_JSON).write_text(json.dumps({**run, "status": "running", "step": 1}))
        assert run_folder.relaunch_errors(cfg) == [], key
        if key in other:
            changed = load_config([*base, f"--{key}", other[key]])
            (error,) = run_folder.relaunch_errors(changed)
            assert f"{key}: {flat[key]!r} → " in error, error


def test_a_dry_run_is_not_refused_by_the_run_in_its_folder(tmp_path):
    """The dry run writes nothing into job.dump_folder, so a finished (or different) run there
    refuses it neither before torch nor after: the README's first command leaves a finished run in
    ./outputs/debug, and a dry run typed next must still lay out its ranks."""
    from torchtitan_loom.config.early import answer_early
    from torchtitan_loom.config.validate import resolve

    args = ["--job.dump_folder", str(tmp_path), "--training.steps", "4"]
    finished = {"identity": run_folder.identity(load_config(args)), "status": "finished", "step": 4}
    (tmp_path / names.RUN_JSON).write_text(json.dumps(finished))
    assert run_folder.relaunch_errors(load_config(args))  # a launch is refused
    for extra in ([], ["--training.seed", "1"]):  # the same run, finished; a different run
        dry = [*args, *extra, "--parallelism.dry_run"]
        assert run_folder.relaunch_errors(load_config(dry)) == []
        answer_early(dry)  # returns: nothing to say before torch
        resolve(load_config(dry), 1)  # and nothing after
