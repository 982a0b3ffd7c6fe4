"""scripts/slurm/multinode.sbatch with fake srun / scontrol / python on PATH (no cluster): the srun
command line, one rank per Slurm task with the first node as MASTER_ADDR, and USR1 120 s before
the time limit sent to the step's tasks (the ranks themselves, no torchrun in between)."""

import os
import signal
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts" / "slurm" / "multinode.sbatch"


def _exe(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_sbatch_runs_one_rank_per_task_with_the_first_node_as_master(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    # scontrol: the allocation's host names, in order.
    _exe(
        bin_dir / "scontrol", '[[ "$1 $2" == "show hostnames" ]] && printf "gpu-a17\\ngpu-b02\\n"\n'
    )
    # srun: record the command line, then run it as each task of a 2-node × 2-task step.
    _exe(
        bin_dir / "srun",
        f"""echo "srun $*" >> {log}
while [[ "$1" == --* ]]; do shift; done
for node in 0 1; do for local in 0 1; do
  SLURM_PROCID=$((node * 2 + local)) SLURM_LOCALID=$local SLURM_NTASKS=4 SLURM_NODEID=$node "$@" || exit $?
done; done
""",
    )
    # python: what each rank would start.
    _exe(
        bin_dir / "fakepython",
        f'echo "rank RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE '
        f'MASTER=$MASTER_ADDR:$MASTER_PORT ARGS=$*" >> {log}\n',
    )
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=str(bin_dir / "fakepython"),
        SLURM_JOB_NODELIST="gpu-a17,gpu-b02",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_SUBMIT_DIR=str(ROOT),
    )
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        ["bash", str(SBATCH), "--training.steps", "5", "--checkpoint.enable"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "2 nodes × 2 ranks, MASTER_ADDR=gpu-a17:29500" in proc.stdout
    lines = log.read_text().splitlines()
    assert lines[0] == (
        f"srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=2 {ROOT}/run_train.sh "
        f"--training.steps 5 --checkpoint.enable"
    )
    train = (
        f"-m torchtitan_loom.train --job.config_file {ROOT}/train_configs/debug_model.toml "
        f"--training.steps 5 --checkpoint.enable"
    )
    assert lines[1:] == [
        f"rank RANK={r} LOCAL_RANK={r % 2} WORLD_SIZE=4 MASTER=gpu-a17:29500 ARGS={train}"
        for r in range(4)
    ]


def test_sbatch_asks_slurm_to_signal_the_ranks_before_the_time_limit():
    directives = [
        line.split(None, 1)[1]
        for line in SBATCH.read_text().splitlines()
        if line.startswith("#SBATCH")
    ]
    # Without "B:" Slurm signals every task of the job steps (here: the ranks), not the batch shell.
    assert "--signal=USR1@120" in directives
    # The trainer saves and exits 0 on SIGUSR1 (components/runtime/preemption.py).
    from torchtitan_loom.components.runtime.preemption import SIGNALS

    assert signal.SIGUSR1 in SIGNALS
