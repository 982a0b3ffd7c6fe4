#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels the GPU image lacks, for benchmarks/gpu_check.sh.
#
#   benchmarks/gpu_wheels.sh [DEST]        # default DEST: <repo>/.whl
#
# Run it on a machine with internet access; the GPU machine has none. The GPU image has Python
# 3.12, torch 2.11 (CUDA), triton, transformers and tensorboard, and lacks torchao (float8),
# torchdata (the loader falls back to torch's DataLoader without it) and pytest (the GPU tests).
# Wheels are for CPython 3.12 on manylinux x86-64 whatever this machine is. Packages that depend
# on torch come without their dependencies (pip would otherwise fetch a multi-GB CUDA torch); pytest
# comes with its whole dependency tree. The folder travels to the GPU machine with the checkout,
# whose transfer limit is 64 MiB in all, so the script fails when the wheels pass MAX_MIB.
#
# Environment: PYTHON (default python3), TORCHAO_VERSION (default 0.18.0; torchao >= 0.17 is
# ABI-stable against torch >= 2.11), TORCHDATA_VERSION (default 0.11.0), MAX_MIB (default 40).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-${ROOT}/.whl}"
PYTHON="${PYTHON:-python3}"
MAX_MIB="${MAX_MIB:-40}"
mkdir -p "${DEST}"
# One wheel per package: gpu_check.sh refuses a folder with two versions of one (stale ones would
# install in glob order). The folder holds only what this script downloads, so it starts empty.
old=("${DEST}"/*.whl)
if [[ -e "${old[0]}" ]]; then
  echo "removing the ${#old[@]} wheels of an earlier download from ${DEST}"
  rm -f -- "${old[@]}"
fi
# manylinux2014 = glibc 2.17; torchao's wheel is tagged manylinux_2_28, so both are named.
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "${DEST}")

"${PYTHON}" -m pip download --quiet --no-deps "${target[@]}" \
  "torchao==${TORCHAO_VERSION:-0.18.0}" "torchdata==${TORCHDATA_VERSION:-0.11.0}"
# pytest >= 8: tests/gpu/conftest.py's per-test alarm is a wrapper hook.
"${PYTHON}" -m pip download --quiet "${target[@]}" "pytest>=8"

echo "wheels in ${DEST}:"
ls -l "${DEST}"/*.whl | awk '{printf "  %8.1f KiB  %s\n", $5 / 1024, $NF}'
total_kib=$(du -sk "${DEST}" | cut -f1)
echo "total: $((total_kib / 1024)) MiB (limit ${MAX_MIB} MiB; the device transfer carries 64 MiB with the tree)"
if (( total_kib > MAX_MIB * 1024 )); then
  echo "error: ${DEST} is larger than ${MAX_MIB} MiB; remove old wheels (rm -r ${DEST}) and run again" >&2
  exit 1
fi
