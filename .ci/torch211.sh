#!/usr/bin/env bash
# The second CI environment: torch 2.11.0 as the package index serves it for Linux x86-64 (the
# cu130 build, ~4.6 GB; it imports and runs on a CPU), which needs Python 3.12. It runs the test
# files named in .ci/torch211_tests.txt: everything that touches parallelism, compile, float8, the
# CUDA trace and checkpoints. Subprocess launches use this environment too (its bin/ first on PATH).
#
#   bash .ci/torch211.sh [pytest args...]     # from the repository root; VENV211 to move the venv
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV211:-$PWD/.cache/venv-torch2.11}"
stamp() { echo "[ci $(date -u +%H:%M:%S)] $*"; }

find_python312() {  # a Python 3.12: on PATH, through pyenv, or in pyenv's versions folder
  local cand
  for cand in "$(command -v python3.12 || true)" "$(PYENV_VERSION=3.12 pyenv which python3.12 2>/dev/null || true)" \
      "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [[ -n "${cand}" && -x "${cand}" ]] || continue
    if "${cand}" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "${cand}"
      return 0
    fi
  done
  return 1
}

if [[ ! -x "${VENV}/bin/python" ]]; then
  PY312="$(find_python312)" || {
    echo "torch211: no Python 3.12 on this machine (torch 2.11.0's x86-64 wheels need it); install one (pyenv install 3.12) and rerun" >&2
    exit 1
  }
  stamp "creating ${VENV} with ${PY312}"
  "${PY312}" -m venv "${VENV}"
fi
t0=${SECONDS}
# --no-compile: byte-compiling torch's and its CUDA libraries' files is most of an install's CPU.
"${VENV}/bin/python" -m pip install -q --no-compile torch==2.11.0
"${VENV}/bin/python" -m pip install -q --no-compile -e ".[dev]"
"${VENV}/bin/python" -c 'import torch; assert torch.__version__.startswith("2.11."), torch.__version__'
stamp "torch 2.11 installed in $(( SECONDS - t0 )) s"
mapfile -t FILES < <(grep -v '^\s*#' .ci/torch211_tests.txt | grep -v '^\s*$')
export PATH="${VENV}/bin:${PATH}"
export TORCHTITAN_LOOM_CACHE="${TORCHTITAN_LOOM_CACHE:-$PWD/.cache/torchtitan_loom}"
t0=${SECONDS}
"${VENV}/bin/python" -m pytest -q -p no:cacheprovider --durations=10 "${FILES[@]}" "$@"
stamp "torch 2.11 tests ran in $(( SECONDS - t0 )) s"
