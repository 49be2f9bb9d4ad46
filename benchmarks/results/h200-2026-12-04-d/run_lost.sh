#!/usr/bin/env bash
# device batch: GPU tests, launches per Reuse layer (this tree), the engine step at 128K this tree against 3d21dab
# (_base, interleaved), the bundled model's decode from CUDA graphs; everything into $OUT/run.log + 3 JSON files
set -u
DEPS=$PWD/benchmarks/.device_deps
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET DSV41_DISABLE_TRITON
t0=$(date +%s)
{
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
PYTHONPATH=$DEPS timeout 300 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -6
echo "== tests done at $(( $(date +%s) - t0 )) s"
PYTHONPATH=$DEPS timeout 150 python3 benchmarks/bench_launches.py --json $OUT/launches_new.json --layers 2 2>&1 | grep -v -i warn | tail -12
echo "== launches done at $(( $(date +%s) - t0 )) s"
for i in 1 2; do for tree in base new; do
  if [ $tree = base ]; then root=$PWD/_base; else root=$PWD; fi
  echo "== engine $tree run $i"
  PYTHONPATH=$root:$DEPS timeout 120 python3 $root/benchmarks/bench_flash_layers.py --engine-only --quick --contexts 131072 \
      --json $OUT/engine_$tree.json 2>&1 | grep "engine decode step" | tail -2
done; done
echo "== engine done at $(( $(date +%s) - t0 )) s"
} > $OUT/run.log 2>&1
tail -45 $OUT/run.log
