#!/usr/bin/env bash
# GPU check for one single-GPU machine, as ONE command of at most TOTAL_S seconds (default 470):
#
#   benchmarks/gpu_check.sh [--dry] [--skip-tests] OUT_DIR
#
# Stages, in order; the first that fails stops the check, and its log tail goes to the summary:
#   deps             install what is not importable (pytest, torchao, torchdata) from the wheels in
#                    $WHEEL_DIR (default <repo>/.whl, made by benchmarks/gpu_wheels.sh) into a
#                    private folder on PYTHONPATH; nothing is downloaded, site-packages is untouched
#   gpu_tests        tests/gpu (flex, float8 kernels, nccl) and tests/unit/test_float8.py
#   bf16_compiled    loom_1p7b, H = 9, bf16, compile on      } benchmarks/throughput.py, AC none:
#   float8_compiled  loom_1p7b, H = 9, float8, compile on    } tokens/s, TFLOP/s, MFU, peak memory
#   bf16_eager       loom_1p7b, H = 9, bf16, compile off     }
#   profile          (PROFILE=1 only) two profiled bf16 compiled steps: time shares and a trace
# OUT_DIR receives summary.md (stages, throughput table, ratios against the goals, the failed
# stage's log tail), gpu_check.log (every stage's log), cells.json and env.txt: four files.
# Exit 0 when every stage passed, 1 when one failed, 2 on bad arguments.
#
# --dry runs the same logic on a CPU (deps check, stage order, limits, summary) with stand-in
# cells: the debug preset on CPU, compile off, float8 emulated with dense layers only, 1 step;
# its numbers are not measurements. --skip-tests skips gpu_tests (a rerun of the cells).
#
# Environment: PYTHON (python3), WHEEL_DIR, SITE_DIR (/tmp/torchtitan_loom_site), TOTAL_S (470),
# STEPS (5 timed steps per cell), WARMUP (2; compilation happens there), BATCH (global batch
# rows, 16), MICRO (micro-batch rows, 8), BENCH_EXTRA (more throughput.py arguments for every
# cell), PROFILE (0), KEEP_WORK (0; 1 keeps the work folder with the bench pack and raw logs).
set -uo pipefail

usage() { sed -n '3,4p' "${BASH_SOURCE[0]}" | sed 's/^# *//' >&2; }
DRY=0 SKIP_TESTS=0 OUT_ARG=""
while (( $# )); do
  case "$1" in
    --dry) DRY=1 ;;
    --skip-tests) SKIP_TESTS=1 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_check: unknown option $1" >&2; usage; exit 2 ;;
    *) if [[ -n "${OUT_ARG}" ]]; then echo "gpu_check: one OUT_DIR only (got ${OUT_ARG} and $1)" >&2; exit 2; fi
       OUT_ARG=$1 ;;
  esac
  shift
done
if [[ -z "${OUT_ARG}" ]]; then echo "gpu_check: OUT_DIR missing" >&2; usage; exit 2; fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "${OUT_ARG}" && cd "${OUT_ARG}" && pwd)"
PYTHON="${PYTHON:-python3}"
WHEEL_DIR="${WHEEL_DIR:-${ROOT}/.whl}"
SITE_DIR="${SITE_DIR:-/tmp/torchtitan_loom_site}"
TOTAL_S="${TOTAL_S:-470}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"  # logs, cell records, the bench pack
mkdir -p "${WORK}/cells" "${SITE_DIR}"
export PYTHONPATH="${SITE_DIR}:${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
export DRY PYTHON WHEEL_DIR SITE_DIR WORK  # read by the stage functions, which run in a child shell
cd "${ROOT}"
STARTED=${SECONDS}
SUMMARY_RESERVE_S=10
log() { echo "[gpu_check $(date -u +%H:%M:%S)] $*"; }
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"${WORK}/stages.tsv"; }

# ---------------------------------------------------------------- stages
deps() {  # install missing modules from the carried wheels (no network, no deps resolution)
  local missing wheels
  missing=($(find_missing pytest torchao torchdata))
  if (( ${#missing[@]} == 0 )); then
    echo "pytest, torchao and torchdata are importable: nothing to install"
    return 0
  fi
  echo "not importable: ${missing[*]}; installing from ${WHEEL_DIR}"
  wheels=("${WHEEL_DIR}"/*.whl)
  if [[ ! -e "${wheels[0]}" ]]; then
    echo "error: no wheels in ${WHEEL_DIR}: run benchmarks/gpu_wheels.sh on a machine with internet and carry .whl/"
    return 1
  fi
  local whl dist
  for whl in "${wheels[@]}"; do
    dist="${whl##*/}"; dist="${dist%%-*}"
    if "${PYTHON}" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "${dist}" >/dev/null 2>&1; then
      continue  # the image has it: keep the image's version
    fi
    echo "installing ${whl##*/}"
    if "${PYTHON}" -m pip --version >/dev/null 2>&1; then
      "${PYTHON}" -m pip install --quiet --no-index --no-deps --target "${SITE_DIR}" "${whl}" || return 1
    else  # a wheel is a zip laid out like site-packages
      "${PYTHON}" -m zipfile -e "${whl}" "${SITE_DIR}" || return 1
    fi
  done
  missing=($(find_missing pytest torchao))  # torchdata is optional (the loader falls back to torch's DataLoader)
  if (( ${#missing[@]} )); then
    echo "error: still not importable: ${missing[*]} (no wheel for it in ${WHEEL_DIR}?)"
    return 1
  fi
}

find_missing() {  # the modules among "$@" that are not importable (found, not imported: fast)
  "${PYTHON}" -c 'import importlib.util, sys; print(*[m for m in sys.argv[1:] if importlib.util.find_spec(m) is None])' "$@"
}

cell() {  # precision compile: one throughput.py cell; passes when its record says "ok"
  local precision=$1 compile=$2 args
  if (( DRY )); then
    args=(--cpu --preset debug --steps 1 --warmup 0 --compile off --float8-experts off
          --training.seq_len 32 --training.global_batch_size 4 --training.micro_batch_size 4)
  else
    args=(--preset loom_1p7b --steps "${STEPS:-5}" --warmup "${WARMUP:-2}" --compile "${compile}"
          --model.num_loops 9 --training.global_batch_size "${BATCH:-16}" --training.micro_batch_size "${MICRO:-8}")
  fi
  # shellcheck disable=SC2086  # BENCH_EXTRA is a list of words
  "${PYTHON}" benchmarks/throughput.py "${args[@]}" --precisions "${precision}" --ac none --out "${WORK}/bench" \
    ${BENCH_EXTRA:-} || return 1
  local json=("${WORK}"/bench/throughput_*.json)
  cp "${json[0]}" "${WORK}/cells/${STAGE}.json"
  "${PYTHON}" -c "import json, sys; c = json.load(open(sys.argv[1]))['cells']; sys.exit(not c or c[0]['status'] != 'ok')" \
    "${WORK}/cells/${STAGE}.json" || { echo "error: the cell did not run (status in the record above)"; return 1; }
}

profile() {
  "${PYTHON}" benchmarks/throughput.py --preset loom_1p7b --precisions bf16 --compile on --ac none --steps 2 \
    --warmup "${WARMUP:-2}" --profile --model.num_loops 9 --training.global_batch_size "${BATCH:-16}" \
    --training.micro_batch_size "${MICRO:-8}" --out "${WORK}/profile"
}

run_stage() {  # name cap_seconds function args...: run it under the time left; record the outcome
  local name=$1 cap=$2
  shift 2
  local left=$(( TOTAL_S - (SECONDS - STARTED) - SUMMARY_RESERVE_S ))
  local limit=$(( cap < left ? cap : left ))
  if (( limit < 15 )); then
    record "${name}" "failed" 0 "" "the ${TOTAL_S} s budget is used up"
    log "${name}: no time left (TOTAL_S=${TOTAL_S})"
    return 1
  fi
  log "${name} (limit ${limit} s) ..."
  local t0=${SECONDS} rc
  # timeout signals the whole process group of the stage: a hung cell does not outlive its limit.
  STAGE=${name} timeout "${limit}" bash -c "$(declare -f deps find_missing cell profile); \"\$@\"" _ "$@" \
    >"${WORK}/${name}.log" 2>&1
  rc=$?
  local took=$(( SECONDS - t0 )) status=ok note=""
  if (( rc == 124 )); then status="timed out"; note="after ${limit} s"
  elif (( rc != 0 )); then status="failed"; note="exit ${rc}"
  fi
  [[ "${name}" == gpu_tests ]] && note="${note:+${note}; }$(grep -E '(passed|failed|skipped|error)' "${WORK}/${name}.log" | tail -n 1)"
  record "${name}" "${status}" "${took}" "${WORK}/${name}.log" "${note}"
  log "${name}: ${status} in ${took} s ${note}"
  [[ "${status}" == ok ]]
}

finish() {
  local failed=$1
  {
    for f in "${WORK}"/*.log; do [[ -e "$f" ]] && { echo "===== ${f##*/}"; cat "$f"; }; done
  } >"${OUT}/gpu_check.log"
  "${PYTHON}" - "${WORK}/cells" "${OUT}/cells.json" <<'EOF'
import json, pathlib, sys
cells = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(cells, indent=1))
EOF
  cp "${WORK}/env.txt" "${OUT}/env.txt" 2>/dev/null
  "${PYTHON}" benchmarks/gpu_summary.py "${WORK}" "${OUT}/summary.md" $( (( DRY )) && echo --dry )
  [[ "${KEEP_WORK:-0}" == 1 ]] || rm -rf "${WORK}"
  if [[ -n "${failed}" ]]; then
    log "stopped at ${failed}; its log tail is in ${OUT}/summary.md"
    exit 1
  fi
  log "all stages passed; summary: ${OUT}/summary.md"
  exit 0
}

# ---------------------------------------------------------------- environment
{
  date -u
  (( DRY )) || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "${PYTHON}" - <<'EOF'
import importlib, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
EOF
} >"${WORK}/env.txt" 2>&1
log "work folder ${WORK}; $(tail -n 1 "${WORK}/env.txt")"

# Compiled cells first: the goals need them; eager is the baseline.
STAGES=(deps:60:deps)
TESTS="tests/gpu tests/unit/test_float8.py"
(( DRY )) && TESTS="tests/gpu"  # on a CPU they all skip: the stage's mechanics only
(( SKIP_TESTS )) || STAGES+=("gpu_tests:120:${PYTHON} -m pytest -q -rs -p no:cacheprovider ${TESTS}")
STAGES+=("bf16_compiled:150:cell bf16 on" "float8_compiled:150:cell float8_tensorwise on" "bf16_eager:90:cell bf16 off")
(( ${PROFILE:-0} == 1 )) && STAGES+=("profile:90:profile")
for spec in "${STAGES[@]}"; do
  name=${spec%%:*}; rest=${spec#*:}; cap=${rest%%:*}; cmd=${rest#*:}
  # shellcheck disable=SC2086  # the command is a list of words
  run_stage "${name}" "${cap}" ${cmd} || finish "${name}"
done
finish ""
