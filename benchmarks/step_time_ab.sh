#!/usr/bin/env bash
# Step time of the debug preset before/after a change, side by side: alternates runs of
# benchmarks/throughput.py from an older tree (BASE_DIR, e.g. `git archive <commit> | tar -x -C DIR`)
# and from this tree, at H = 9 and H = 3 (equal tokens: the preset's 16 x 256 batch), one thread
# each (the cores may be shared), and prints one line per run.
#
#   benchmarks/step_time_ab.sh BASE_DIR OUT_DIR
#
# Environment: PREC (float32 default, or bfloat16), ROUNDS (default "1 2"), STEPS (timed steps per
# run, default 2, after 1 warm-up step).
set -uo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: $0 BASE_DIR OUT_DIR" >&2
  exit 2
fi
NEW="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="$(cd "$1" && pwd)"
OUT="$(mkdir -p "$2" && cd "$2" && pwd)"
PREC="${PREC:-float32}"
export OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
common=(--cpu --preset debug --precisions bf16 --compile off --ac none --steps "${STEPS:-2}" --warmup 1
        --training.mixed_precision_param "${PREC}")
# One pack for every run, written by this tree's benchmark (its data format is unchanged).
(cd "${NEW}" && PYTHONPATH="${NEW}" python benchmarks/throughput.py "${common[@]}" --steps 0 --warmup 0 \
  --out "${OUT}/pack" >/dev/null 2>&1)
PACK="$(ls -d "${OUT}"/pack/bench-pack-* | head -n 1)"
for round in ${ROUNDS:-1 2}; do
  for H in 9 3; do
    for tree in base new; do
      root="${NEW}"; [[ "${tree}" == base ]] && root="${BASE}"
      cell="${OUT}/${PREC}-r${round}-${tree}-h${H}"
      (cd "${root}" && PYTHONPATH="${root}" python benchmarks/throughput.py "${common[@]}" --out "${cell}" \
        --data.path "${PACK}" --model.num_loops "${H}" >"${cell}.log" 2>&1)
      python - "${cell}/throughput_debug.json" "${tree}" "${H}" "${round}" "${PREC}" <<'PY'
import json, sys
path, tree, H, rnd, prec = sys.argv[1:]
c = json.load(open(path))["cells"][0]
step = c.get("step_time_s")
print(f"{prec} round {rnd} {tree:4s} H={H}: {c['status']}"
      + (f" step {step:.3f} s, {c['tokens_per_s']:,.0f} tok/s, final loss {c['final_loss']:.6f}" if step else ""),
      flush=True)
PY
    done
  done
done
