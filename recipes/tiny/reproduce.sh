#!/usr/bin/env bash
# Rebuild the bundled dsv41-tiny checkpoint from scratch on one CUDA GPU (an H200 here):
# data build (CPU, ~3 min), stage 1 (mixed data), stage 2 (continued, code/reasoning-heavy mix), evaluation.
#   bash recipes/tiny/reproduce.sh [OUT_DIR]      (default: model/assets/dsv41-tiny)
set -euo pipefail
OUT=${1:-model/assets/dsv41-tiny}
PY=${PY:-python}
STAGE1=$(mktemp -d)/stage1
$PY -m recipes.tiny.build_data
$PY -m recipes.tiny.train --out "$STAGE1" --backbone-seconds 260 --dspark-seconds 55 \
    --history recipes/tiny/logs/stage1_history.json
rm -rf "$OUT.new"
$PY -m recipes.tiny.train --init-from "$STAGE1" --out "$OUT.new" --lr 2e-3 \
    --mix prose=0.15,code=0.35,literature=0.08,reasoning=0.42 --backbone-seconds 125 --dspark-seconds 25 \
    --history recipes/tiny/logs/stage2_history.json
rm -rf "$OUT" && mv "$OUT.new" "$OUT"
$PY -m recipes.tiny.plot
$PY -m recipes.tiny.evaluate --model "$OUT" --output recipes/tiny/logs/eval.json
