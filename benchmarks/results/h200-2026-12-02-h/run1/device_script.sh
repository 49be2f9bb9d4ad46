#!/usr/bin/env bash
# device run 1 (2026-12-02): split vs tiles prefill attention, CED stack prefill with both, expert sweep, GPU tests
set -u
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET DSV41_DISABLE_TRITON
start=$(date +%s)
note() { echo "$1: exit $2 after $(( $(date +%s) - start )) s" | tee -a $OUT/steps.txt; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)";
  git rev-parse HEAD; git status --short | head -20; } > $OUT/env.txt 2>&1
(cd benchmarks && timeout 120 python3 bench_sparse_attention.py --quick --no-sweep --json $OUT/sparse_attention.json > $OUT/sparse_attention.log 2>&1); note sparse_attention $?
(cd benchmarks && timeout 170 python3 bench_ced.py --prefill-variants tiles split --json $OUT/ced.json > $OUT/ced.log 2>&1); note ced $?
(cd benchmarks && timeout 130 python3 bench_experts.py --quick --sweep --json $OUT/experts.json > $OUT/experts.log 2>&1); note experts $?
left=$(( 575 - ($(date +%s) - start) ))
timeout $left python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_kernels_gemm.py -p no:cacheprovider --durations=5 > $OUT/gpu_tests.log 2>&1; note gpu_tests $?
tail -5 $OUT/gpu_tests.log
grep -A12 "^== " $OUT/sparse_attention.log | head -30
tail -8 $OUT/ced.log
grep "T=" $OUT/experts.log | tail -30
