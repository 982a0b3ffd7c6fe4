"""The exit code an elastic agent acts on (components/runtime/preemption.py, launch.py): a rank that
stops only because a peer asked exits RESTART under torchrun's elastic agent with restarts left,
while a rank that was signalled itself (a preemption) exits 0 as documented; a launcher's death
stops the run after the step also with checkpoints off; run_train.sh's elastic config check."""

import signal
from pathlib import Path

import pytest

from torchtitan_loom import launch
from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.runtime.preemption import ElasticRestarts, PreemptionWatcher

CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"  # cwd-independent

ELASTIC = {
    "TORCHELASTIC_RUN_ID": "loom-1",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "3",
}


@pytest.fixture
def elastic(monkeypatch):
    for key, value in ELASTIC.items():
        monkeypatch.setenv(key, value)


def _stopped_by_a_peer(**kwargs):
    watcher = PreemptionWatcher(enabled=False, **kwargs)
    watcher.observe(1.0)  # the step's statistics said another rank got a stop request
    return watcher


def test_a_rank_stopped_by_a_peer_asks_its_elastic_agent_to_restart(elastic):
    watcher = _stopped_by_a_peer()
    try:
        assert watcher.exit_code() == exit_codes.RESTART != 0
        assert "exiting 3: torchrun's elastic agent (run loom-1, 3 of 3 restarts left)" in (
            watcher.exit_note()
        )
        assert watcher.why() == "a peer rank was stopped (a signal, or its launcher is gone)"
    finally:
        watcher.close()


def test_a_preempted_rank_exits_0_under_an_elastic_agent(elastic):
    watcher = PreemptionWatcher(enabled=True)
    try:
        signal.raise_signal(signal.SIGTERM)  # the scheduler's signal, through the agent or not
        watcher.observe(1.0)
        assert watcher.exit_code() == exit_codes.OK
        # The signal may land during the stop's save, after the ranks agreed: read at exit.
        late = _stopped_by_a_peer()
        late.received = signal.SIGUSR1
        assert late.exit_code() == exit_codes.OK
        late.close()
    finally:
        watcher.close()


def test_a_planned_stop_exits_0_under_an_elastic_agent(elastic):
    watcher = PreemptionWatcher(enabled=True, exit_after_step=4)
    try:
        assert watcher.stop_after(4) == "checkpoint.exit_after_step = 4 reached"
        assert watcher.exit_code() == exit_codes.OK
    finally:
        watcher.close()


@pytest.mark.parametrize(
    "env",
    [
        {},
        {**ELASTIC, "TORCHELASTIC_RESTART_COUNT": "3"},
        {**ELASTIC, "TORCHELASTIC_MAX_RESTARTS": "0"},
    ],
    ids=["no agent", "restarts used up", "no restarts"],
)
def test_without_restarts_left_a_peer_stop_exits_0(env, monkeypatch):
    for key in ELASTIC:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert not ElasticRestarts.from_env(env).restarts_left
    watcher = _stopped_by_a_peer()
    try:
        assert watcher.exit_code() == exit_codes.OK
        assert watcher.exit_note() == "exiting 0, relaunch the same command to resume"
    finally:
        watcher.close()


def test_a_lost_launcher_stops_after_the_step_with_checkpoints_off(elastic, capfd):
    # Without handlers (checkpoints off) a SIGTERM to itself used to kill the rank mid-step, and
    # its peer died on "Connection reset by peer" inside the next collective.
    watcher = PreemptionWatcher(enabled=False)
    try:
        assert not watcher.installed and watcher.requested() == 0
        watcher._launcher_lost("the launcher (parent pid 7) is gone")
        assert watcher.requested() == signal.SIGTERM  # every rank agrees through the step's flag
        assert watcher.stop_after(9) == "the launcher (parent pid 7) is gone: stopped after step 9"
        assert watcher.exit_code() == exit_codes.OK  # nobody is left to read it
    finally:
        watcher.close()
    assert "the launcher (parent pid 7) is gone: stopping after this step" in capfd.readouterr().out


def test_the_elastic_config_check_covers_every_world_size_a_restart_may_bring(tmp_path, capsys):
    base = [
        "--job.config_file",
        f"{CONFIGS}/debug_model.toml",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    assert launch.run(base + ["--check-config=1,2"], None) == exit_codes.OK
    assert capsys.readouterr().out.strip() == str(tmp_path / "run")  # for the rendezvous id
    pinned = base + ["--parallelism.dp_shard", "2", "--check-config=1,2,3"]
    assert launch.run(pinned, None) == exit_codes.BAD_INPUT
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("config error: at world size 1: parallelism.dp_shard = 2:")
    assert err[1].startswith("config error: at world size 3: parallelism.dp_shard = 2:")
    assert "elastic run restarts at any of the world sizes 1, 2, 3" in err[2] and len(err) == 3


def test_a_later_round_of_the_same_elastic_run_takes_the_run_lock_over(tmp_path):
    import json

    from torchtitan_loom.components.runtime.run_folder import LOCK, RunFolderError, RunLock

    # Rank 0 of the earlier round ran on a host that is gone: its pid cannot be checked from here.
    held = {"host": "lost-node-7", "pid": 4242, "run_id": "r0", "elastic_run": "loom-1"}
    (tmp_path / LOCK).write_text(json.dumps(held))
    with pytest.raises(RunFolderError, match="in use by a live run: pid 4242 on host lost-node-7"):
        RunLock(str(tmp_path), "r1", log=lambda m: None)  # not an elastic launch
    with pytest.raises(RunFolderError, match="in use by a live run"):
        RunLock(str(tmp_path), "r1", log=lambda m: None, elastic_run="loom-2")  # another run
    said = []
    lock = RunLock(str(tmp_path), "r1", log=said.append, elastic_run="loom-1")
    assert json.loads((tmp_path / LOCK).read_text())["run_id"] == "r1"
    assert said == [
        f"taking over {tmp_path / LOCK} from an earlier round of elastic run loom-1 "
        "(pid 4242 on lost-node-7)"
    ]
    lock.release()
    # torchrun's default run id of a static launch is "none": never an elastic run of its own.
    assert ElasticRestarts("none", 0, 3).elastic_run == ""
    assert ElasticRestarts("loom-1", 0, 0).elastic_run == ""
    assert ElasticRestarts("loom-1", 2, 3).elastic_run == "loom-1"


def test_the_elastic_config_check_refuses_job_overwrite(tmp_path, capsys):
    argv = ["--job.dump_folder", str(tmp_path / "run"), "--job.overwrite", "--check-config=1,2"]
    assert launch.run(["--job.config_file", f"{CONFIGS}/debug_model.toml", *argv], None) == 2
    assert "job.overwrite: an elastic run would move its own files aside" in capsys.readouterr().err
