#!/usr/bin/env bash
# Rebuild the bundled dsv41-tiny checkpoint from scratch on one CUDA GPU (an H200 here), exactly the
# stages the shipped checkpoint went through (recipes/tiny/README.md):
#   1-2  text only (drafter labels = data tokens), batch 128         (2026-11-29, b2c9688; 7.9 min)
#   3-4  + the vision tower, trained jointly; batch 256                (2026-11-29, 4261929)
#   5    the DSpark drafter alone, labels = the target's greedy tokens (2026-11-29, 4261929)
#   6-7  an image batch in every step, 70% reasoning text, the first reasoning token weighted x4;
#        stage 7 ends with the drafter again                          (2026-11-29, 1753cc0)
#   8-9  more of the same (lr 8e-4, then 5e-4); 10 the drafter again   (2026-11-29, d9cab46)
#   11-13 the same options with the reasoning task in the trace styles "twice", "labelled", "undo"
#        (evals/tasks/tiny_reasoning), each stage ending with the drafter  (2026-11-30, 0417a82)
#   14   "undo" again on the CPU, batch 8, the closing sum weighted x5
#   15-16 the vision tower alone through the frozen language model, on the CPU, with the probe loss added
#        and padded canvas sizes (16: also larger ones)                    (2026-11-30, 0417a82)
#   26   the "graded" reasoning traces (a shortcut at effort 20-44, the terse sums at 45-69), 70% of the rows,
#        then the drafter                                                  (2026-12-02, issue #25; 8.1 min held)
#   27   the vision tower alone again, as stage 16, on the CPU             (2026-12-02)
#   29   stage 26's text rows, an image batch in every step, 60% of them the v2 pictures (shades, backgrounds,
#        32-1024 px, other phrasings), then the drafter                     (2026-12-03, issue #25; 7.3 min held)
#   30   the tower through linear probes first (both picture sets), then stage 29's steps with 75% v2 batches
#        and the probes' loss kept, then the drafter                         (2026-12-03, issue #25; 9.4 min held)
#   32   as 30 with the v2 pictures drawn less uniformly (--vision-robust), 80% v2 batches  (2026-12-03; 7.9 min)
#   33   stage 32's call again                                              (2026-12-03; 7.8 min)
#   34   as 33 with a 180 s probe stage and 200 s of joint steps             (2026-12-03; 7.9 min)
#   35-36 stage 34's call twice more                                        (2026-12-03; 7.9 and 7.8 min)
#   bash recipes/tiny/reproduce.sh [OUT_DIR]      (default: model/assets/dsv41-tiny)
set -euo pipefail
OUT=${1:-model/assets/dsv41-tiny}
PY=${PY:-python}
WORK=$(mktemp -d)
$PY -m dsv41.recipes.tiny.build_data
for style in twice labelled undo; do $PY -m dsv41.recipes.tiny.build_data --reasoning-only $style; done
$PY -m dsv41.recipes.tiny.train --out "$WORK/s1" --no-vision --dspark-labels data \
    --backbone-seconds 260 --dspark-seconds 55 --history recipes/tiny/logs/stage1_history.json
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s1" --out "$WORK/s2" --no-vision --dspark-labels data --lr 2e-3 \
    --mix prose=0.15,code=0.35,literature=0.08,reasoning=0.42 --backbone-seconds 125 --dspark-seconds 25 \
    --history recipes/tiny/logs/stage2_history.json
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s2" --out "$WORK/s3" --batch 256 --lr 2e-3 \
    --mix prose=0.15,code=0.30,literature=0.07,reasoning=0.48 --backbone-seconds 465 --dspark-seconds 0 \
    --tower-seconds 40 --vision-every 3 --vision-batch 256 --vision-workers 6 \
    --history recipes/tiny/logs/stage3_history.json
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s3" --out "$WORK/s4" --batch 256 --lr 1.5e-3 \
    --mix prose=0.18,code=0.34,literature=0.08,reasoning=0.40 --backbone-seconds 250 \
    --dspark-seconds 190 --dspark-batch 128 --vision-every 3 --vision-batch 256 --vision-workers 6 \
    --history recipes/tiny/logs/stage4_history.json
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s4" --out "$WORK/s5" --backbone-seconds 0 \
    --dspark-seconds 320 --dspark-batch 128 --dspark-lr 1.5e-3 --vision-workers 1 \
    --history recipes/tiny/logs/stage5_history.json
FOCUS=(--batch 96 --mix prose=0.12,code=0.12,literature=0.06,reasoning=0.7 --vision-every 1 --vision-batch 256
       --think-start-weight 4 --vision-workers 6)
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s5" --out "$WORK/s6" "${FOCUS[@]}" --lr 1e-3 \
    --backbone-seconds 349 --dspark-seconds 0 --history recipes/tiny/logs/stage6_history.json
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s6" --out "$WORK/s7" "${FOCUS[@]}" --lr 6e-4 \
    --backbone-seconds 250 --dspark-seconds 190 --dspark-batch 128 --dspark-lr 1.5e-3 \
    --history recipes/tiny/logs/stage7_history.json
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s7" --out "$WORK/s8" "${FOCUS[@]}" --lr 8e-4 \
    --backbone-seconds 440 --dspark-seconds 0 --history recipes/tiny/logs/stage8_history.json
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s8" --out "$WORK/s9" "${FOCUS[@]}" --lr 5e-4 \
    --backbone-seconds 530 --dspark-seconds 0 --history recipes/tiny/logs/stage9_history.json
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s9" --out "$WORK/s10" --backbone-seconds 0 \
    --dspark-seconds 180 --dspark-batch 128 --dspark-lr 1.5e-3 --vision-workers 1 \
    --history recipes/tiny/logs/stage10_history.json
DRAFTER=(--dspark-batch 128 --dspark-lr 1.5e-3)
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s10" --out "$WORK/s11" "${FOCUS[@]}" \
    --mix prose=0.12,code=0.12,literature=0.06,reasoning_twice=0.7 --lr 5e-4 --backbone-seconds 400 \
    --dspark-seconds 110 "${DRAFTER[@]}" --history recipes/tiny/logs/stage11_history.json
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s11" --out "$WORK/s12" "${FOCUS[@]}" \
    --mix prose=0.12,code=0.12,literature=0.06,reasoning_labelled=0.7 --lr 5e-4 --backbone-seconds 425 \
    --dspark-seconds 85 "${DRAFTER[@]}" --history recipes/tiny/logs/stage12_history.json
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s12" --out "$WORK/s13" "${FOCUS[@]}" \
    --mix prose=0.12,code=0.12,literature=0.06,reasoning_undo=0.7 --lr 5e-4 --backbone-seconds 405 \
    --dspark-seconds 70 "${DRAFTER[@]}" --history recipes/tiny/logs/stage13_history.json
# stages 14-15 ran on a 2-core CPU; their budgets are wall-clock, so a faster machine takes more steps
$PY -m dsv41.recipes.tiny.train --device cpu --init-from "$WORK/s13" --out "$WORK/s14" --batch 8 \
    --mix prose=0.05,code=0.05,literature=0.03,reasoning_undo=0.87 --vision-every 2 --vision-batch 16 \
    --vision-workers 1 --think-start-weight 4 --closing-sum-weight 5 --lr 2e-4 --backbone-seconds 1200 \
    --dspark-seconds 0 --history recipes/tiny/logs/stage14_history.json
rm -rf "$OUT.new"
$PY -m dsv41.recipes.tiny.vision.train --base "$WORK/s14" --out "$WORK/s15" --continue-tower --seconds 840 --batch 16 \
    --lr 5e-4 --tower-lr-scale 1.0 --padded-sides --probe-weight 0.5 --threads 2 --eval-examples 10
cp "$WORK/s15/vision_train.json" recipes/tiny/logs/stage15_vision_train.json
$PY -m dsv41.recipes.tiny.vision.train --base "$WORK/s15" --out "$WORK/s16" --continue-tower --seconds 780 --batch 16 \
    --lr 3e-4 --tower-lr-scale 1.0 --padded-sides --large-sides --probe-weight 0.5 --threads 2 --eval-examples 10
cp "$WORK/s16/vision_train.json" recipes/tiny/logs/stage16_vision_train.json
# stage 26 ran on one H200 through recipes/tiny/graded_device.sh (literature left out of the mix there only because
# the carried data had to fit the 64 MiB transfer); the same options:
$PY -m dsv41.recipes.tiny.build_data --reasoning-only graded
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s16" --out "$WORK/s26" --batch 192 \
    --mix prose=0.15,code=0.15,reasoning_graded=0.70 --vision-every 2 --vision-batch 256 --vision-workers 12 \
    --think-start-weight 4 --closing-sum-weight 5 --lr 4e-4 --backbone-seconds 370 --dspark-seconds 100 \
    --dspark-batch 128 --dspark-lr 1.5e-3 --history recipes/tiny/logs/trials-2026-12-02/stage26_history.json
$PY -m dsv41.recipes.tiny.vision.train --base "$WORK/s26" --out "$WORK/s27" --continue-tower --seconds 780 --batch 16 \
    --lr 3e-4 --tower-lr-scale 1.0 --padded-sides --large-sides --probe-weight 0.5 --threads 2 --eval-examples 10
cp "$WORK/s27/vision_train.json" recipes/tiny/logs/trials-2026-12-02/stage27_vision_train.json
# stage 29 ran on one H200 through recipes/tiny/graded_device.sh 29 (the data as for stage 26); the same options:
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s27" --out "$WORK/s29" --batch 192 \
    --mix prose=0.15,code=0.15,reasoning_graded=0.70 --vision-every 1 --vision-batch 256 --vision-workers 14 \
    --vision-variety-share 0.6 --think-start-weight 4 --closing-sum-weight 5 --lr 2.5e-4 --backbone-seconds 330 \
    --dspark-seconds 90 --dspark-batch 128 --dspark-lr 1.5e-3 \
    --history recipes/tiny/logs/trials-2026-12-03/stage29_history.json
# stage 30 likewise (graded_device.sh 30):
$PY -m dsv41.recipes.tiny.train --init-from "$WORK/s29" --out "$WORK/s30" --batch 192 \
    --mix prose=0.15,code=0.15,reasoning_graded=0.70 --vision-every 1 --vision-batch 256 --vision-workers 14 \
    --vision-variety-share 0.75 --retrain-tower --tower-seconds 75 --tower-batch 256 --tower-lr 1e-3 \
    --probe-weight 0.5 --probe-batch 128 --think-start-weight 4 --closing-sum-weight 5 --lr 2.5e-4 \
    --backbone-seconds 290 --dspark-seconds 90 --dspark-batch 128 --dspark-lr 1.5e-3 \
    --history recipes/tiny/logs/trials-2026-12-03/stage30_history.json
# stages 32-36 likewise (graded_device.sh 32 to 36): the v2 pictures in the robust style; 32 and 33 the same call,
# 34-36 the same call with a longer probe stage and fewer joint steps
for stage in 32 33 34 35 36; do
    from=$((stage == 32 ? 30 : stage - 1)); tower=110; joint=270
    if [ "$stage" -ge 34 ]; then tower=180; joint=200; fi
    dest="$WORK/s$stage"; [ "$stage" = 36 ] && dest="$OUT.new"
    $PY -m dsv41.recipes.tiny.train --init-from "$WORK/s$from" --out "$dest" --batch 192 \
        --mix prose=0.15,code=0.15,reasoning_graded=0.70 --vision-every 1 --vision-batch 256 --vision-workers 14 \
        --vision-variety-share 0.8 --vision-robust --retrain-tower --tower-seconds $tower --tower-batch 256 \
        --tower-lr 1e-3 --probe-weight 0.5 --probe-batch 128 --think-start-weight 4 --closing-sum-weight 5 \
        --lr 2.5e-4 --backbone-seconds $joint --dspark-seconds 70 --dspark-batch 128 --dspark-lr 1.5e-3 \
        --history recipes/tiny/logs/trials-2026-12-03/stage${stage}_history.json
done
rm -rf "$OUT" && mv "$OUT.new" "$OUT"
$PY -m dsv41.recipes.tiny.plot
$PY -m dsv41.recipes.tiny.evaluate --model "$OUT" --output recipes/tiny/logs/eval.json
$PY -m dsv41.recipes.tiny.vision.accuracy --model "$OUT" --n 100 --json > recipes/tiny/logs/vision_accuracy.json
$PY -m dsv41.recipes.tiny.vision.accuracy --model "$OUT" --n 200 --questions colour,shape --json \
    > recipes/tiny/logs/vision_accuracy_n200.json
