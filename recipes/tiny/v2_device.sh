#!/usr/bin/env bash
# dsv41-tiny v2 on one H200 (recipes/tiny/README.md, "v2"; every stage below ran on 2026-12-02, none is shipped).
# One stage per call, each inside a 10-minute device call (setup ~40 s, export ~10 s, the rest the stage's
# wall-clock budget), each continuing the one before with --init-from:
#
#   bash recipes/tiny/v2_device.sh 17      # from the shipped checkpoint   (first design of the v2 traces)
#   bash recipes/tiny/v2_device.sh 18      # ends with the drafter
#   bash recipes/tiny/v2_device.sh 20      # from 18                      (second design, redesigned tool calls)
#   bash recipes/tiny/v2_device.sh 21      # ends with the drafter
#   bash recipes/tiny/v2_device.sh 22      # ends with the drafter
#
# The rows: mostly the v2 reasoning task (reasoning_v2, its slips masked out of the loss), prose/code/literature
# as in stages 6-13, tool calls (20-22: only the assistant's turns trained, x3); v2 pictures (--vision-variety);
# the first reasoning token x4 (it names the tier). Needs, built on a CPU machine and carried (the device reaches
# nothing outside it; DATA holds only the families of the mix, since the tree travels with a 64 MiB limit):
#   python -m dsv41.recipes.tiny.build_data --out DATA          # prose, code, literature, token map
#   python -m dsv41.recipes.tiny.build_data --reasoning-v2 --out DATA   # + reasoning_v2 and its mask (the
#                          # design in evals/tasks/tiny_reasoning/v2.py at the stage's commit; stage 22 adds
#                          # --v2-top-share 0.3 --v2-error-rate 0.5)
#   python -m dsv41.recipes.tiny.build_data --tools --out DATA  # + tools and its mask
#   bash recipes/tiny/pack_device_deps.sh                       # DATA/pil312.tar.xz when the device lacks Pillow
# and the previous stage's checkpoint under $RUNS (default runs/tiny-v2), kept on the warm machine between
# back-to-back calls or passed as FROM (a 46 MB checkpoint does not fit beside the tree as a carried path).
# Every stage writes RUNS/sSTAGE (official layout) and recipes/tiny/logs/stageSTAGE_{history.json,train.log}.
set -euo pipefail
STAGE=${1:?stage: 17, 18, 20, 21 or 22}
RUNS=${RUNS:-runs/tiny-v2}
mkdir -p "$RUNS" recipes/tiny/logs
V2=(--batch 96 --mix prose=0.12,code=0.12,literature=0.06,reasoning_v2=0.66,tools=0.04 --vision-every 1 --vision-batch 256
    --vision-variety --vision-workers 6 --think-start-weight 4)
case "$STAGE" in
  17) FROM=${FROM:-model/assets/dsv41-tiny}; OPTS=(--lr 5e-4 --backbone-seconds 480 --dspark-seconds 0) ;;
  18) FROM=${FROM:-$RUNS/s17}; OPTS=(--lr 3e-4 --backbone-seconds 380 --dspark-seconds 150 --dspark-batch 128 --dspark-lr 1.5e-3) ;;
  # The second design of the v2 traces (copy, then the same pass twice; evals/tasks/tiny_reasoning/v2.py) and the
  # tool calls with token-identical arguments and an assistant-only loss (x3, --mask-weight): from the first
  # run's stage 18, twice the text rows per step (the step is host-bound: docs/performance.md, "Training step"),
  # pictures every other step.
  20|21|22) V2=(--batch 192 --mask-weight tools=3 --vision-every 2 --vision-batch 256 --vision-variety
                --vision-workers 12 --think-start-weight 4)
            MIX=prose=0.10,code=0.10,literature=0.05,reasoning_v2=0.60,tools=0.15 ;;&
  # stage 22: twice the tool rows (the calls were right but for the copied value after stage 21), and the
  # reasoning family rebuilt with --v2-top-share 0.3 --v2-error-rate 0.5 (stage 21 wrote reasoning at effort 1,
  # and its comparison line named the last value written whatever the passes gave)
  22) MIX=prose=0.10,code=0.10,literature=0.05,reasoning_v2=0.45,tools=0.30 ;;&
  20|21|22) V2+=(--mix "$MIX") ;;&
  20) FROM=${FROM:-$RUNS/s18}; OPTS=(--lr 4e-4 --backbone-seconds 470 --dspark-seconds 0) ;;
  21) FROM=${FROM:-$RUNS/s20}; OPTS=(--lr 2.5e-4 --backbone-seconds 340 --dspark-seconds 150 --dspark-batch 128 --dspark-lr 1.5e-3) ;;
  22) FROM=${FROM:-$RUNS/s21}; OPTS=(--lr 2.5e-4 --backbone-seconds 240 --dspark-seconds 70 --dspark-batch 128 --dspark-lr 1e-3) ;;
  *) echo "unknown stage $STAGE (17, 18, 20, 21 or 22)" >&2; exit 2 ;;
esac
[ -f "$FROM/config.json" ] || { echo "missing $FROM: run the stage before first" >&2; exit 2; }
bash recipes/tiny/device_run.sh --init-from "$FROM" --out "$RUNS/s$STAGE" "${V2[@]}" "${OPTS[@]}" \
    --history "recipes/tiny/logs/stage${STAGE}_history.json" --log "recipes/tiny/logs/stage${STAGE}_train.log"
