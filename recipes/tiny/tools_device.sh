#!/usr/bin/env bash
# Stage 19 of dsv41-tiny on one H200 (recipes/tiny/README.md, "Stage 19: tool calls"): the shipped checkpoint of
# stage 16 continued on its own mix (the "undo" reasoning traces, prose, code, literature, v1 pictures every
# step) with 25% of the rows tool-call conversations (recipes/tiny/tool_calls.py), then the drafter again.
# One 10-minute device call:
#
#   DATA=runs/data-v2 bash recipes/tiny/tools_device.sh
#
# $DATA (default .tinydata) holds, built on a CPU machine and carried (the device reaches nothing outside it):
#   python -m dsv41.recipes.tiny.build_data                        # prose, code, literature, the Engram map
#   python -m dsv41.recipes.tiny.build_data --reasoning-only undo  # reasoning_undo.u32.xz
#   python -m dsv41.recipes.tiny.build_data --tools                # tools.u32.xz
# Stage 19 ran on the tree of 2302002: the first tool-call design, without the loss mask that --tools has
# written since (train.py applies a family's mask whenever DATA holds it), so a rerun on a later tree differs.
set -euo pipefail
RUNS=${RUNS:-runs/tiny-v2}
FROM=${FROM:-model/assets/dsv41-tiny}
mkdir -p "$RUNS" recipes/tiny/logs
bash recipes/tiny/device_run.sh --init-from "$FROM" --out "$RUNS/s19" \
    --batch 96 --mix prose=0.12,code=0.12,literature=0.06,reasoning_undo=0.45,tools=0.25 \
    --vision-every 1 --vision-batch 256 --vision-workers 6 --think-start-weight 4 --closing-sum-weight 5 \
    --lr 3e-4 --backbone-seconds 330 --dspark-seconds 120 --dspark-batch 128 --dspark-lr 1.5e-3 \
    --history recipes/tiny/logs/stage19_history.json --log recipes/tiny/logs/stage19_train.log
