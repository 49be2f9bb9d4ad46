#!/usr/bin/env bash
# device run 5 (2026-12-02): the 32K stack prefill with the projections' GEMMs on the Triton kernel, then on cuBLAS, same run
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset TRITON_INTERPRET DSV41_DISABLE_TRITON
start=$(date +%s)
{ date -u; git rev-parse HEAD; git status --short | head -30; } > $OUT/env.txt 2>&1
(cd benchmarks && timeout 70 python3 -c "
import runpy, sys
from dsv41.model.kernels import gemm
gemm.CUBLAS_MIN_M = 1 << 30  # the Triton kernel at every M, as before this change
sys.argv = ['bench_ced.py', '--json', '$OUT/ced_triton_gemm.json']
runpy.run_path('bench_ced.py', run_name='__main__')" > $OUT/ced_triton_gemm.log 2>&1); echo "ced_triton_gemm: exit $? after $(( $(date +%s) - start )) s"
(cd benchmarks && timeout 70 python3 bench_ced.py --json $OUT/ced.json > $OUT/ced.log 2>&1); echo "ced: exit $? after $(( $(date +%s) - start )) s"
tail -3 $OUT/ced_triton_gemm.log; tail -3 $OUT/ced.log
