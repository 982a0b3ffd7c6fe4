"""scripts/slurm/multinode.sbatch with fake srun / scontrol / python on PATH (no cluster): the srun
command line, one rank per Slurm task with the first node as MASTER_ADDR, and USR1 120 s before
the time limit sent to the step's tasks (the ranks themselves, no torchrun in between); a host list
longer than a pipe buffer; the elastic form (one torchrun agent per node)."""

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
    # No config file named: the trainer applies its default preset itself (config/early.py).
    train = "-m torchtitan_loom.train --training.steps 5 --checkpoint.enable"
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


def _fake_cluster(tmp_path, hostnames_cmd='printf "gpu-a17\\ngpu-b02\\n"'):
    """Fake scontrol, srun (runs its command once per node, as task 0 of that node) and python
    (records what it was asked to run; prints a dump folder for the elastic config check)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    _exe(bin_dir / "scontrol", f'[[ "$1 $2" == "show hostnames" ]] && {{ {hostnames_cmd}; }}\n')
    _exe(
        bin_dir / "srun",
        f"""echo "srun $*" >> {log}
while [[ "$1" == --* ]]; do shift; done
for node in 0 1; do SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_NTASKS=2 "$@" || exit $?; done
""",
    )
    _exe(
        bin_dir / "fakepython",
        f'echo "python NNODES=$NNODES ARGS=$*" >> {log}\n'
        '[[ "$*" == *--check-config=* ]] && echo /runs/elastic\n'
        "exit 0\n",
    )
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=str(bin_dir / "fakepython"),
        SLURM_JOB_NODELIST="gpu-a17,gpu-b02",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_CPUS_PER_TASK="3",
        SLURM_SUBMIT_DIR=str(ROOT),
    )
    for key in ("MASTER_PORT", "NNODES", "NGPU", "RDZV_ID", "MAX_RESTARTS", "LAUNCHER"):
        env.pop(key, None)
    return env, log


def test_sbatch_reads_a_host_list_longer_than_a_pipe_buffer(tmp_path):
    # `scontrol ... | head -n 1` under pipefail: head exits after one line, scontrol gets SIGPIPE
    # writing the rest, and the batch script died with exit 141 before launching anything.
    env, log = _fake_cluster(tmp_path, 'echo gpu-a17; seq -f "gpu-%07g" 1 300000')
    proc = subprocess.run(
        ["bash", str(SBATCH), "--training.steps", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert "MASTER_ADDR=gpu-a17:29500" in proc.stdout
    assert log.read_text().startswith("srun --kill-on-bad-exit=1")


def test_sbatch_elastic_form_runs_one_torchrun_agent_per_node(tmp_path):
    env, log = _fake_cluster(tmp_path)
    proc = subprocess.run(
        ["bash", str(SBATCH), "--checkpoint.enable"],
        env=dict(env, ELASTIC_MIN_NODES="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "elastic 1:2 nodes × 2 ranks, rendezvous gpu-a17:29500" in proc.stdout
    lines = log.read_text().splitlines()
    assert lines[0] == (
        f"srun --kill-on-bad-exit=0 --nodes=2 --ntasks-per-node=1 --cpus-per-task=6 "
        f"{ROOT}/run_train.sh --checkpoint.enable"
    )
    rdzv_id = (
        "loom-"
        + subprocess.run(
            "printf %s /runs/elastic | cksum", shell=True, capture_output=True, text=True
        ).stdout.split()[0]
    )
    train = "-m torchtitan_loom.train --checkpoint.enable"
    agent = (
        f"python NNODES=1:2 ARGS=-m torch.distributed.run --nnodes 1:2 --rdzv-backend c10d "
        f"--rdzv-endpoint gpu-a17:29500 --rdzv-id {rdzv_id} --rdzv-conf last_call_timeout=10 "
        f"--max-restarts 3 --nproc_per_node 2 --local-ranks-filter 0 --role rank --tee 3 {train}"
    )
    # Per node: the config checked at every world size a restart may bring, then one agent.
    check = f"python NNODES=1:2 ARGS={train} --check-config=2,4"
    assert lines[1:] == [check, agent, check, agent]
