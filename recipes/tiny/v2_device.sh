#!/usr/bin/env bash
# dsv41-tiny v2 on one H200 (recipes/tiny/README.md, "v2 plan"; not yet run). One stage per call, each inside a
# 10-minute device call (setup ~40 s, export ~10 s, the rest the stage's wall-clock budget), each continuing the
# one before with --init-from:
#
#   bash recipes/tiny/v2_device.sh 17      # from the shipped checkpoint
#   bash recipes/tiny/v2_device.sh 18
#   bash recipes/tiny/v2_device.sh 19      # ends with the drafter
#
# Stages 17-19: 70% of the rows the v2 reasoning task (reasoning_v2, its slips masked out of the loss), the rest
# prose/code/literature as in stages 6-13; an image batch of 256 v2 pictures (--vision-variety) in every step;
# the first reasoning token x4 (it names the tier). Needs, built on a CPU machine and carried (the device reaches
# nothing outside it):
#   python -m dsv41.recipes.tiny.build_data                     # .tinydata: prose, code, literature, token map
#   python -m dsv41.recipes.tiny.build_data --reasoning-v2      # + reasoning_v2.u32.xz, reasoning_v2.mask.u8.xz
#   bash recipes/tiny/pack_device_deps.sh                       # .tinydata/pil312.tar.xz when the device lacks Pillow
# and the previous stage's checkpoint (under $RUNS, default runs/tiny-v2; carry it between calls, ~47 MB).
# Every stage writes RUNS/sSTAGE (official layout) and recipes/tiny/logs/stageSTAGE_{history.json,train.log}.
set -euo pipefail
STAGE=${1:?stage: 17 or 18}
RUNS=${RUNS:-runs/tiny-v2}
mkdir -p "$RUNS" recipes/tiny/logs
V2=(--batch 96 --mix prose=0.12,code=0.12,literature=0.06,reasoning_v2=0.66,tools=0.04 --vision-every 1 --vision-batch 256
    --vision-variety --vision-workers 6 --think-start-weight 4)
case "$STAGE" in
  17) FROM=${FROM:-model/assets/dsv41-tiny}; OPTS=(--lr 5e-4 --backbone-seconds 480 --dspark-seconds 0) ;;
  18) FROM=${FROM:-$RUNS/s17}; OPTS=(--lr 3e-4 --backbone-seconds 380 --dspark-seconds 150 --dspark-batch 128 --dspark-lr 1.5e-3) ;;
  *) echo "unknown stage $STAGE (17 or 18)" >&2; exit 2 ;;
esac
[ -f "$FROM/config.json" ] || { echo "missing $FROM: run the stage before first" >&2; exit 2; }
bash recipes/tiny/device_run.sh --init-from "$FROM" --out "$RUNS/s$STAGE" "${V2[@]}" "${OPTS[@]}" \
    --history "recipes/tiny/logs/stage${STAGE}_history.json" --log "recipes/tiny/logs/stage${STAGE}_train.log"
