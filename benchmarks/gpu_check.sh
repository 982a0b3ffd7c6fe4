#!/usr/bin/env bash
# GPU check for a single-GPU machine (about 9 minutes): install what is missing from carried
# wheels, run the GPU-only tests, then the throughput matrix of loom_329m and loom_1p7b.
#
#   benchmarks/gpu_check.sh OUT_DIR
#
# Everything is written under OUT_DIR: env.txt, gpu_tests.log / .xml, float8_unit.log,
# bench/throughput_<preset>.{json,md} (+ .log), profile/ (trace + time shares), summary.md.
# Exit code 0 when every part passed.
#
# Missing packages (torchao, torchdata, tomli, numpy, pytest and its deps) are installed from the
# wheels in $WHEEL_DIR (default: <repo>/.whl, git-ignored) into a private folder put on PYTHONPATH
# (pip --no-index --no-deps --target): nothing is downloaded and site-packages is left alone.
# Fetch the wheels on a machine with internet (see benchmarks/README.md):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
#     torchao==0.18.0 torchdata==0.11.0 tomli numpy pytest pluggy iniconfig packaging
#
# Environment: WHEEL_DIR, SITE_DIR (default /tmp/torchtitan_loom_site), PYTHON (default python3),
# STEPS_329M / STEPS_1P7B (timed steps per cell, defaults 20 / 15; 3 warm-up steps come first),
# BUDGET_329M_S / BUDGET_1P7B_S (seconds after which a preset's remaining cells are skipped,
# defaults 100 / 180), PRESETS (default "loom_329m loom_1p7b"),
# BENCH_EXTRA (more benchmarks/throughput.py arguments for every preset, e.g. "--compile off"),
# PROFILE (1 = also profile two loom_1p7b steps, the default; 0 = skip).
set -uo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
PYTHON="${PYTHON:-python3}"
WHEEL_DIR="${WHEEL_DIR:-${ROOT}/.whl}"
SITE_DIR="${SITE_DIR:-/tmp/torchtitan_loom_site}"
cd "${ROOT}"
status=0
log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "${OUT}/gpu_check.log"; }

# ---------------------------------------------------------------- 1. dependencies from wheels
# module name -> distribution name of its wheel file
declare -A DIST=([torchao]=torchao [torchdata]=torchdata [tomli]=tomli [numpy]=numpy [pytest]=pytest
                 [pluggy]=pluggy [iniconfig]=iniconfig [packaging]=packaging)
mkdir -p "${SITE_DIR}"
export PYTHONPATH="${SITE_DIR}:${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
for mod in torchao torchdata tomli numpy pytest pluggy iniconfig packaging; do
  if "${PYTHON}" -c "import ${mod}" >/dev/null 2>&1; then
    continue
  fi
  if [[ "${mod}" == tomli ]] && "${PYTHON}" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    continue  # Python 3.11+ reads TOML with the standard tomllib; tomli is only needed below
  fi
  wheels=("${WHEEL_DIR}/${DIST[$mod]}"-*.whl)
  if [[ ! -e "${wheels[0]}" ]]; then
    log "MISSING: ${mod} is not importable and no ${DIST[$mod]}-*.whl in ${WHEEL_DIR}"
    status=1
    continue
  fi
  log "installing ${wheels[-1]##*/} into ${SITE_DIR}"
  if "${PYTHON}" -m pip --version >/dev/null 2>&1; then
    "${PYTHON}" -m pip install --quiet --no-index --no-deps --target "${SITE_DIR}" "${wheels[-1]}" \
      >>"${OUT}/gpu_check.log" 2>&1 || { log "pip could not install ${wheels[-1]##*/}"; status=1; }
  else
    # No pip: a wheel is a zip laid out like site-packages, so unpacking it is an install.
    "${PYTHON}" -m zipfile -e "${wheels[-1]}" "${SITE_DIR}" || { log "could not unpack ${mod}"; status=1; }
  fi
done

{
  date
  nvidia-smi 2>&1 || true
  "${PYTHON}" - <<'EOF'
import importlib, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for name in ("torchao", "torchdata", "triton", "flash_attn", "numpy", "pytest"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:  # report, do not stop: the tests skip what is missing
        print(name, "not importable:", type(exc).__name__, exc)
EOF
} >"${OUT}/env.txt" 2>&1
log "environment: $(grep -E '^(python|gpu|torchao|triton) ' "${OUT}/env.txt" | tr '\n' ';')"

# ---------------------------------------------------------------- 2. GPU-only tests (~1-2 min)
log "GPU tests (tests/gpu) ..."
timeout 240 "${PYTHON}" -m pytest -q -rs tests/gpu --junitxml="${OUT}/gpu_tests.xml" >"${OUT}/gpu_tests.log" 2>&1
rc=$?
log "GPU tests exit ${rc}: $(tail -n 1 "${OUT}/gpu_tests.log")"
(( rc == 0 )) || status=1
# The float8 converter / validation unit tests, with this machine's torch and torchao.
timeout 90 "${PYTHON}" -m pytest -q tests/unit/test_float8.py >"${OUT}/float8_unit.log" 2>&1
rc=$?
log "float8 unit tests exit ${rc}: $(tail -n 1 "${OUT}/float8_unit.log")"
(( rc == 0 )) || status=1

# ---------------------------------------------------------------- 3. throughput (~5 min)
# One GPU, reduced global batch. Cells run AC none (compile off, then on) before AC loop, so a
# budget cut drops the AC-loop cells first; a cell the trainer rejects is reported "unsupported".
bench() {  # preset steps budget_s timeout_s overrides...
  local preset=$1 steps=$2 budget=$3 limit=$4
  shift 4
  log "throughput ${preset} ..."
  # shellcheck disable=SC2086  # BENCH_EXTRA is a list of words
  timeout "${limit}" "${PYTHON}" benchmarks/throughput.py --preset "${preset}" --steps "${steps}" --warmup 3 \
    --time-budget-s "${budget}" --out "${OUT}/bench" "$@" ${BENCH_EXTRA:-} >"${OUT}/bench/throughput_${preset}.log" 2>&1
  local rc=$?
  log "throughput ${preset} exit ${rc}"
  (( rc == 0 )) || status=1
}
mkdir -p "${OUT}/bench"
PRESETS="${PRESETS:-loom_329m loom_1p7b}"
for preset in ${PRESETS}; do
  case "${preset}" in
    loom_329m) bench loom_329m "${STEPS_329M:-20}" "${BUDGET_329M_S:-100}" 150 \
                 --training.global_batch_size 16 --training.micro_batch_size 8 ;;
    loom_1p7b) bench loom_1p7b "${STEPS_1P7B:-15}" "${BUDGET_1P7B_S:-180}" 260 \
                 --training.global_batch_size 8 --training.micro_batch_size 4 ;;
    *) bench "${preset}" "${STEPS_329M:-20}" 60 120 ;;
  esac
done

# ---------------------------------------------------------------- 4. profile (~1 min)
# Two profiled steps of loom_1p7b, bf16, compile off, AC none: a Chrome trace under
# OUT/profile/traces/ and the share of step time in GEMMs, attention, all-to-all, other.
# PROFILE=0 skips it.
if [[ "${PROFILE:-1}" == 1 ]]; then
  log "profile loom_1p7b ..."
  mkdir -p "${OUT}/profile"
  timeout 200 "${PYTHON}" benchmarks/throughput.py --preset loom_1p7b --precisions bf16 --compile off --ac none \
    --steps 2 --warmup 2 --profile --out "${OUT}/profile" --training.global_batch_size 8 \
    --training.micro_batch_size 4 >"${OUT}/profile/profile.log" 2>&1
  rc=$?
  log "profile exit ${rc}: $(grep ' profile: ' "${OUT}/profile/profile.log" | tail -n 1)"
  (( rc == 0 )) || status=1
fi

{
  echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  cat "${OUT}/env.txt"
  echo '```'
  echo
  echo "GPU tests: $(tail -n 1 "${OUT}/gpu_tests.log")"
  echo
  for preset in ${PRESETS}; do
    [[ -f "${OUT}/bench/throughput_${preset}.md" ]] && cat "${OUT}/bench/throughput_${preset}.md" && echo
  done
  [[ -f "${OUT}/profile/throughput_loom_1p7b.md" ]] && cat "${OUT}/profile/throughput_loom_1p7b.md" && echo
  grep -hE '^\[torchtitan_loom\] (attention backend|layer [0-9]+: routed experts)' "${OUT}"/bench/*.log 2>/dev/null \
    | sort | uniq -c || true
} >"${OUT}/summary.md"
log "done, exit ${status}; summary: ${OUT}/summary.md"
exit "${status}"
