#!/usr/bin/env bash
# One device call for the Triton kernels (about 5 minutes on one H200; the first run, GEMM and experts
# only, took 67 s):
#   1. their GPU tests (tests/test_kernels.py and tests/test_kernels_gemm.py, -m gpu) -> $OUT/gpu_tests.log
#   2. ceilings + every kernel benchmark (sparse attention, indexer, mHC, KV pack, GEMM, experts), short
#      timing windows -> $OUT/*.json, bench.log.  ONLY="gemm experts" limits step 2 to those kernels.
# Each step has its own time limit, so a hang in one still leaves the other's output. Run from anywhere:
#   OUT=/some/dir bash benchmarks/device_batch.sh
# (on the lent machine $OUT is the folder whose files come back). The CPU-side compile check,
# benchmarks/compile_kernels.py, is not repeated here: the tests compile the same kernels.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
PY=${PYTHON:-python3}
source benchmarks/device_lib.sh
record_env

if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 150 "$PY" -m pytest -q -m gpu tests/test_kernels.py tests/test_kernels_gemm.py -p no:cacheprovider --durations=5 \
    > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu_tests.log"
else
  echo "pytest is not installed: GPU tests skipped" | tee "$OUT/gpu_tests.log"
fi

ONLY_ARGS=()
[ -n "${ONLY:-}" ] && ONLY_ARGS=(--only $ONLY)
timeout 240 "$PY" benchmarks/run_all_kernels.py --quick "${ONLY_ARGS[@]}" --out "$OUT" > "$OUT/bench.log" 2>&1
echo "benchmarks: exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
tail -n 45 "$OUT/bench.log"
