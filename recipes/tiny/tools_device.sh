#!/usr/bin/env bash
# Tool-call stages of dsv41-tiny on one H200 (recipes/tiny/README.md, "Tool calls"), each one 10-minute device call
# continuing the shipped checkpoint of stage 16 on its own mix (the "undo" reasoning traces, prose, code,
# literature, v1 pictures) with tool-call conversations (recipes/tiny/tool_calls.py), then the drafter again:
#
#   DATA=runs/data-v2 bash recipes/tiny/tools_device.sh 19      # first design, 25% tools rows
#   DATA=runs/data-t23 RUNS=runs/tiny-t23 bash recipes/tiny/tools_device.sh 23 [train.py options that override]
#   DATA=runs/data-t23 RUNS=runs/tiny-t23 bash recipes/tiny/tools_device.sh 24      # a diagnostic, also from 16
#
# $DATA (default .tinydata) holds, built on a CPU machine and carried (the device reaches nothing outside it; the
# tree travels with a 64 MiB limit, so DATA holds only the families of the mix, recompressed with xz -9e for 23):
#   python -m dsv41.recipes.tiny.build_data                        # prose, code, literature, the Engram map
#   python -m dsv41.recipes.tiny.build_data --reasoning-only undo  # reasoning_undo.u32.xz
#   python -m dsv41.recipes.tiny.build_data --tools                # tools.u32.xz and (since stage 20) its mask
# Stage 19 ran on the tree of 2302002: the first tool-call design, without the loss mask that --tools has
# written since (train.py applies a family's mask whenever DATA holds it), so a rerun on a later tree differs.
# Stage 23 (2026-12-02): the redesigned family (token-identical arguments, keyword-named thinking, the
# assistant-only mask x3) with argument values drawn from a space too large to memorize (invented names and
# words, lists of 1-99), since stages 20-22 wrote one constant value per tool; 192 text rows a step and pictures
# every other step (the step is host-bound: more rows a second, so more tool rows in the call).
set -euo pipefail
STAGE=${1:-19}
shift || true
RUNS=${RUNS:-runs/tiny-v2}
FROM=${FROM:-model/assets/dsv41-tiny}
mkdir -p "$RUNS" recipes/tiny/logs
case $STAGE in
  19) OPTS=(--batch 96 --mix prose=0.12,code=0.12,literature=0.06,reasoning_undo=0.45,tools=0.25
            --vision-every 1 --vision-batch 256 --vision-workers 6 --think-start-weight 4 --closing-sum-weight 5
            --lr 3e-4 --backbone-seconds 330 --dspark-seconds 120 --dspark-batch 128 --dspark-lr 1.5e-3)
      LOGS=recipes/tiny/logs ;;
  23) OPTS=(--batch 192 --mix prose=0.12,code=0.12,literature=0.06,reasoning_undo=0.45,tools=0.25
            --mask-weight tools=3 --vision-every 2 --vision-batch 256 --vision-workers 12 --think-start-weight 4
            --closing-sum-weight 5 --lr 3e-4 --backbone-seconds 340 --dspark-seconds 110 --dspark-batch 128
            --dspark-lr 1.5e-3)
      LOGS=recipes/tiny/logs/trials-2026-12-02 ;;
  # stage 24 (a diagnostic, not for shipping; from 16 too, since a 46 MB checkpoint does not fit the transfer):
  # stage 23 wrote no call right (0 / 60), not even the frame reliably, so
  # about twice the tool rows and their weight: 60% tools rows, trained targets x5, no drafter
  24) # from FROM as 23
      OPTS=(--batch 192 --mix prose=0.08,code=0.08,literature=0.04,reasoning_undo=0.20,tools=0.60
            --mask-weight tools=5 --vision-every 2 --vision-batch 256 --vision-workers 12 --think-start-weight 4
            --closing-sum-weight 5 --lr 3e-4 --backbone-seconds 270 --dspark-seconds 0)
      LOGS=recipes/tiny/logs/trials-2026-12-02 ;;
  *) echo "unknown stage $STAGE (19, 23 or 24)" >&2; exit 2 ;;
esac
mkdir -p "$LOGS"
bash recipes/tiny/device_run.sh --init-from "$FROM" --out "$RUNS/s$STAGE" "${OPTS[@]}" \
    --history "$LOGS/stage${STAGE}_history.json" --log "$LOGS/stage${STAGE}_train.log" "$@"
