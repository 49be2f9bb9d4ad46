#!/usr/bin/env bash
# The GPU run of the dsv41-tiny recipe: a 2-step smoke pass of every stage at full batch size (fails
# fast, before the budget is spent), then training, export and evaluation.
# Run from a directory holding model/, evals/ and recipes/, with DATA built by build_data.py.
#   DATA=.tinydata OUT=out BACKBONE_S=260 DSPARK_S=55 bash recipes/tiny/device_run.sh
set -euo pipefail
DATA=${DATA:-.tinydata}
OUT=${OUT:-out}
BACKBONE_S=${BACKBONE_S:-260}
DSPARK_S=${DSPARK_S:-55}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, tokenizers, safetensors; print('torch', torch.__version__, torch.cuda.get_device_name())"
rm -rf /tmp/tiny-smoke /tmp/tiny-ckpt
$PY -m recipes.tiny.train --data "$DATA" --out /tmp/tiny-smoke --max-steps 2 --backbone-seconds 60 --dspark-seconds 30
$PY -m recipes.tiny.evaluate --model /tmp/tiny-smoke --quick --token-map "$DATA/engram_token_map.i32.xz"
echo "=== smoke pass ok"
$PY -m recipes.tiny.train --data "$DATA" --out /tmp/tiny-ckpt --backbone-seconds "$BACKBONE_S" \
    --dspark-seconds "$DSPARK_S" --history "$OUT/history.json" --log "$OUT/train.log"
cp /tmp/tiny-ckpt/model-*.safetensors /tmp/tiny-ckpt/model.safetensors.index.json "$OUT/"
$PY -m recipes.tiny.evaluate --model /tmp/tiny-ckpt --output "$OUT/results.json" \
    --token-map "$DATA/engram_token_map.i32.xz"
