#!/usr/bin/env bash
# Launch torchtitan_loom training with torchrun (single node or multi-node).
#
#   ./run_train.sh                                             # debug model on the bundled corpus
#   ./run_train.sh --job.config_file train_configs/loom_1p7b.toml
#   NGPU=8 CONFIG_FILE=train_configs/loom_329m.toml ./run_train.sh --training.steps 100
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=host0 ./run_train.sh --job.config_file train_configs/loom_1p7b.toml
#
# Environment: NGPU (processes per node; default: visible GPUs, else 1), CONFIG_FILE (used unless
# --job.config_file is given), LOG_RANK (ranks whose output is shown, default 0), NNODES /
# NODE_RANK / MASTER_ADDR / MASTER_PORT for several nodes (WORLD_SIZE / RANK from a scheduler are
# read as node count / node rank when NNODES / NODE_RANK are unset, as in the seed launcher).
# LAUNCHER=srun (scripts/slurm/multinode.sbatch): this process is one rank, started by srun as
# Slurm task SLURM_PROCID of SLURM_NTASKS; MASTER_ADDR / MASTER_PORT come from the sbatch script.
# Every other argument is a config override (--section.key value), passed through unchanged.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
CONFIG_FILE="${CONFIG_FILE:-${ROOT}/train_configs/debug_model.toml}"
LOG_RANK="${LOG_RANK:-0}"
if [[ "${LAUNCHER:-}" == "srun" ]]; then
  NGPU=1  # one rank per process; OMP threads = the CPUs Slurm gave this task
elif [[ -z "${NGPU:-}" ]]; then
  NGPU="$("${PYTHON}" -c 'import torch; print(torch.cuda.device_count() or 1)' 2>/dev/null || echo 1)"
fi
NNODES="${NNODES:-${WORLD_SIZE:-1}}"
NODE_RANK="${NODE_RANK:-${RANK:-0}}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
# torchrun sets its own WORLD_SIZE / RANK for the workers; drop the scheduler's node-level ones.
unset WORLD_SIZE RANK

# An explicit --job.config_file wins over CONFIG_FILE.
overrides=("$@")
for arg in "$@"; do
  case "$arg" in
    --help|-h) exec "${PYTHON}" -m torchtitan_loom.train --help ;;
    --job.config_file|--job.config_file=*|--job.config-file|--job.config-file=*) CONFIG_FILE="" ;;
  esac
done
config_args=()
[[ -n "${CONFIG_FILE}" ]] && config_args=(--job.config_file "${CONFIG_FILE}")

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}"
export PYTORCH_ALLOC_CONF="${PYTORCH_ALLOC_CONF:-expandable_segments:True}"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

launch=(-m torchtitan_loom.train "${config_args[@]}" "${overrides[@]}")
if [[ "${LAUNCHER:-}" == "srun" ]]; then
  # Each rank checks the config itself before any process group exists (exit 2 on every rank).
  export RANK="${SLURM_PROCID}" LOCAL_RANK="${SLURM_LOCALID}" WORLD_SIZE="${SLURM_NTASKS}"
  exec "${PYTHON}" "${launch[@]}"
fi
if (( NNODES == 1 && NGPU == 1 )); then
  # One process needs no rendezvous; running it directly keeps its exit code (2 = config error or
  # spike abort), which torchrun would turn into 1.
  export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1
  exec "${PYTHON}" "${launch[@]}"
fi

# Check the config for the whole world before starting any rank: errors exit 2 here.
WORLD_SIZE=$(( NNODES * NGPU )) "${PYTHON}" "${launch[@]}" --check-config

if (( NNODES > 1 )); then
  rdzv=(--nnodes "${NNODES}" --node_rank "${NODE_RANK}" --master_addr "${MASTER_ADDR}" --master_port "${MASTER_PORT}")
else
  rdzv=(--standalone --nnodes 1)
fi
exec "${PYTHON}" -m torch.distributed.run "${rdzv[@]}" --nproc_per_node "${NGPU}" \
  --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 "${launch[@]}"
