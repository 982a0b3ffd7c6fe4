#!/usr/bin/env bash
# Launch torchtitan_loom training with torchrun (single node or multi-node).
#
#   ./run_train.sh                                             # debug model on the bundled corpus
#   ./run_train.sh --job.config_file train_configs/loom_1p7b.toml
#   NGPU=8 CONFIG_FILE=train_configs/loom_329m.toml ./run_train.sh --training.steps 100
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=host0 ./run_train.sh --job.config_file train_configs/loom_1p7b.toml
#   NNODES=6:8 MASTER_ADDR=host0 ./run_train.sh --job.config_file train_configs/loom_1p7b.toml  # elastic
#
# Environment: NGPU (processes per node; default: visible GPUs, else 1), CONFIG_FILE (used unless
# --job.config_file is given), LOG_RANK (ranks whose output is shown, default 0), NNODES /
# NODE_RANK / MASTER_ADDR / MASTER_PORT for several nodes (WORLD_SIZE / RANK from a scheduler are
# read as node count / node rank when NNODES / NODE_RANK are unset, as in the seed launcher).
# Elastic (NNODES=MIN:MAX, the same command on every node, NODE_RANK unused): torchrun's c10d
# rendezvous at MASTER_ADDR:MASTER_PORT (its agent there hosts the store: that host must outlive
# the run), run id RDZV_ID (default: derived from the absolute dump folder), MAX_RESTARTS (default
# 3) restarts after a failure, RDZV_CONF (default last_call_timeout=10: how long a rendezvous that
# reached MIN nodes waits for more); a lost node restarts the rest at the new world size from the
# newest checkpoint, a new node joins at a restart (docs/parallelism.md#elastic-training).
# LAUNCHER=srun (scripts/slurm/multinode.sbatch): this process is one rank, started by srun as
# Slurm task SLURM_PROCID of SLURM_NTASKS; MASTER_ADDR / MASTER_PORT come from the sbatch script.
# Every other argument is a config override (--section.key value), passed through unchanged.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
# Empty: the trainer's default preset, train_configs/debug_model.toml (config/early.py).
CONFIG_FILE="${CONFIG_FILE:-}"
LOG_RANK="${LOG_RANK:-0}"
if [[ "${LAUNCHER:-}" == "srun" ]]; then
  NGPU=1  # one rank per process; OMP threads = the CPUs Slurm gave this task
elif [[ -z "${NGPU:-}" ]]; then
  # Counted without importing torch (seconds of silence on a cold start): the devices
  # CUDA_VISIBLE_DEVICES names when it is set, else nvidia-smi's list; 1 (a CPU rank) when none.
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    NGPU=$(tr ',' '\n' <<<"${CUDA_VISIBLE_DEVICES}" | grep -c '[^[:space:]]' || true)
  elif command -v nvidia-smi >/dev/null 2>&1; then
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  fi
  (( ${NGPU:-0} > 0 )) || NGPU=1
fi
if ! [[ "${NGPU}" =~ ^[1-9][0-9]{0,3}$ ]]; then
  echo "run_train.sh: NGPU=${NGPU}: expected the number of processes per node, 1 to 9999" >&2
  exit 2
fi
NNODES="${NNODES:-${WORLD_SIZE:-1}}"
if ! [[ "${NNODES}" =~ ^[1-9][0-9]{0,4}$ || "${NNODES}" == *:* ]]; then
  echo "run_train.sh: NNODES=${NNODES}: expected a node count ≥ 1 (or MIN:MAX for an elastic run)" >&2
  exit 2
fi
NODE_RANK="${NODE_RANK:-${RANK:-0}}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
# torchrun sets its own WORLD_SIZE / RANK for the workers; drop the scheduler's node-level ones.
unset WORLD_SIZE RANK

# An explicit --job.config_file wins over CONFIG_FILE.
overrides=("$@")
help=0
args=("$@")
# Options only: the word after an option without '=' is its value (--job.description -h is text).
for (( i = 0; i < ${#args[@]}; i++ )); do
  case "${args[i]}" in
    --help|-h) help=1 ;;
    --job.config_file|--job.config_file=*|--job.config-file|--job.config-file=*) CONFIG_FILE="" ;;
  esac
  if [[ "${args[i]}" == --* && "${args[i]}" != *=* && $(( i + 1 )) -lt ${#args[@]} \
        && "${args[i+1]}" != --* ]]; then
    (( i += 1 ))
  fi
done
config_args=()
[[ -n "${CONFIG_FILE}" ]] && config_args=(--job.config_file "${CONFIG_FILE}")
# --help shows the values this very command would run with (the preset file applied).
(( help )) && exec "${PYTHON}" -m torchtitan_loom.train "${config_args[@]}" "${overrides[@]}"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}"
export PYTORCH_ALLOC_CONF="${PYTORCH_ALLOC_CONF:-expandable_segments:True}"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

launch=(-m torchtitan_loom.train "${config_args[@]}" "${overrides[@]}")
if [[ "${LAUNCHER:-}" == "srun" ]]; then
  # Each rank checks the config itself before any process group exists (exit 2 on every rank).
  export RANK="${SLURM_PROCID}" LOCAL_RANK="${SLURM_LOCALID}" WORLD_SIZE="${SLURM_NTASKS}"
  exec "${PYTHON}" "${launch[@]}"
fi
if [[ "${NNODES}" == *:* ]]; then
  MIN_NODES="${NNODES%%:*}" MAX_NODES="${NNODES#*:}"
  if ! [[ "${MIN_NODES}" =~ ^[0-9]+$ && "${MAX_NODES}" =~ ^[0-9]+$ ]] \
      || (( MIN_NODES < 1 || MIN_NODES > MAX_NODES )); then
    echo "run_train.sh: NNODES=${NNODES}: expected MIN:MAX node counts with 1 ≤ MIN ≤ MAX" >&2
    exit 2
  fi
  MAX_RESTARTS="${MAX_RESTARTS:-3}"
  if ! [[ "${MAX_RESTARTS}" =~ ^[0-9]+$ ]]; then
    echo "run_train.sh: MAX_RESTARTS=${MAX_RESTARTS}: expected a count ≥ 0" >&2
    exit 2
  fi
  # A restart may bring any node count in MIN..MAX: the config must hold at each (exit 2 here).
  worlds=""
  for (( n = MIN_NODES; n <= MAX_NODES; n++ )); do worlds+="${worlds:+,}$(( n * NGPU ))"; done
  dump="$("${PYTHON}" "${launch[@]}" --check-config="${worlds}")"
  RDZV_ID="${RDZV_ID:-loom-$(printf '%s' "${dump}" | cksum | cut -d' ' -f1)}"
  rdzv=(--nnodes "${NNODES}" --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT}"
        --rdzv-id "${RDZV_ID}" --rdzv-conf "${RDZV_CONF:-last_call_timeout=10}"
        --max-restarts "${MAX_RESTARTS}")
  # torch 2.13's shared rendezvous store: a node that stays rank 0 across rounds does not publish
  # the new round's MASTER_ADDR, so a node joining at a restart waits for it until it times out.
  # Without sharing, each round's rank 0 publishes a fresh address for the workers' own store.
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
  echo "run_train.sh: elastic ${NNODES} nodes × ${NGPU}, rendezvous ${MASTER_ADDR}:${MASTER_PORT}, run id ${RDZV_ID}, ${MAX_RESTARTS} restarts"
  # torchrun logs every worker exit but 0 as an error; exit 3 is the workers' own "lost a peer,
  # restart me" (each said why in one line), so that one line of torchrun's is dropped.
  exec "${PYTHON}" -m torch.distributed.run "${rdzv[@]}" --nproc_per_node "${NGPU}" \
    --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 "${launch[@]}" \
    2> >(grep -v --line-buffered -E '\] failed \(exitcode: 3\) local_rank:' >&2)
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
