#!/usr/bin/env bash
# Issue #9's follow-up measurements, one GPU, about 4 minutes:
#   launches.json   kernel launches per Reuse layer at V4.1-Flash width, eager and from a CUDA graph
#                   (capture needed the device-held RoPE table: model/layers.py rope_frequencies_on)
#   gaps.json       where the missed targets lose their time (benchmarks/diagnose_gaps.py)
#   indexer.json    the indexer benchmark with the deep pool's real shape (blocks of 8) beside random entries
#   train_step.json the tiny recipe's training step after the host-work cuts (docs/performance.md)
# Each step has its own time limit and logs to $OUT/NAME.log. Run from the repository root:
#   OUT=/some/dir bash benchmarks/device_batch_gaps.sh     (carry .tinydata/*.xz for the training step)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench_out}
source benchmarks/device_lib.sh
if [ -f .tinydata/pil312.tar.xz ] && ! "$PY" -c "import PIL" 2>/dev/null; then  # the training step draws images
  mkdir -p /tmp/pylib && tar xJf .tinydata/pil312.tar.xz -C /tmp/pylib && export PYTHONPATH=/tmp/pylib:${PYTHONPATH:-}
fi
record_env
step launches 90 "$PY" benchmarks/bench_launches.py --json "$OUT/launches.json"
step gaps 120 "$PY" benchmarks/diagnose_gaps.py --json "$OUT/gaps.json"
step indexer 60 "$PY" benchmarks/bench_indexer.py --json "$OUT/indexer.json"
step train_step 120 "$PY" benchmarks/bench_train_step.py --data .tinydata --out "$OUT/train_step.json" --batches 64,256 --steps 3
