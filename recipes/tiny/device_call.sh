#!/usr/bin/env bash
# The two halves of a training stage's device call that run on the CPU machine (recipes/tiny/README.md, the
# stages from 29 on), so that neither is done by hand:
#
#   bash recipes/tiny/device_call.sh prepare FROM      # FROM: the starting checkpoint's directory
#   ... the device call, from the repository root, with DATA carried:
#       mkdir -p /tmp/r/logs; DATA=runs/data-tNN-carry RUNS=/tmp/r LOGS=/tmp/r/logs timeout 540 \
#         bash recipes/tiny/graded_device.sh NN > /tmp/r/logs/stageNN_device_stdout.log 2>&1; \
#       cd /tmp/r/sNN && cp model-00001-of-00003.safetensors config.json $OUT/ && \
#         for f in model-0000[23]-of-00003.safetensors; do split -b 15M $f $OUT/$f.part; done; \
#       tar czf $OUT/logs.tgz -C /tmp/r logs
#   bash recipes/tiny/device_call.sh collect FILES_AT runs/tiny-tNN/sNN
#
# prepare: the tree must travel within the 64 MiB limit with the carried data, so recipes/tiny/logs and
# tests/fixtures (which no stage reads) move to a holding directory outside the tree, and FROM's shards are copied
# over model/assets/dsv41-tiny (graded_device.sh starts from there). collect: the bundled shards are restored from
# git, the moved directories come back, and the returned files (the device returns at most 16 MiB a file, hence
# the 15 MiB parts) are assembled into OUT as a whole checkpoint, with the stage's logs in OUT/../logs. A second
# prepare before a collect is refused, so nothing moved is overwritten.
set -euo pipefail
cd "$(dirname "$0")/../.."
HOLD=${DSV41_DEVICE_HOLD:-/tmp/dsv41-device-hold}
ASSETS=model/assets/dsv41-tiny
SHARDS=(model-00001-of-00003.safetensors model-00002-of-00003.safetensors model-00003-of-00003.safetensors)
usage() { echo "usage: device_call.sh prepare FROM | collect FILES_AT OUT" >&2; exit 2; }

case ${1:-} in
  prepare)
    [ $# -eq 2 ] || usage
    from=$2
    for f in "${SHARDS[@]}" config.json; do
      [ -f "$from/$f" ] || { echo "prepare: $from/$f does not exist" >&2; exit 2; }
    done
    cmp -s "$from/config.json" "$ASSETS/config.json" \
      || { echo "prepare: $from/config.json differs from $ASSETS/config.json (another architecture)" >&2; exit 2; }
    [ ! -e "$HOLD" ] || { echo "prepare: $HOLD exists (a call not yet collected?)" >&2; exit 2; }
    mkdir -p "$HOLD"
    mv recipes/tiny/logs "$HOLD/logs"
    mv tests/fixtures "$HOLD/fixtures"
    cp "${SHARDS[@]/#/$from/}" "$ASSETS/"
    echo "prepared: $from over $ASSETS; logs and fixtures in $HOLD" >&2 ;;
  collect)
    [ $# -eq 3 ] || usage
    at=$2 out=$3
    git checkout -- "$ASSETS"
    if [ -d "$HOLD" ]; then
      mv "$HOLD/logs" recipes/tiny/logs
      mv "$HOLD/fixtures" tests/fixtures
      rmdir "$HOLD"
    fi
    for f in model-00002-of-00003.safetensors model-00003-of-00003.safetensors; do
      compgen -G "$at/$f.part*" > /dev/null || { echo "collect: no $at/$f.part* (the call did not finish?)" >&2; exit 2; }
    done
    [ -f "$at/model-00001-of-00003.safetensors" ] && [ -f "$at/config.json" ] \
      || { echo "collect: $at lacks the first shard or config.json" >&2; exit 2; }
    tmp="$out.part"
    rm -rf "$tmp" && mkdir -p "$tmp"
    cp "$at/config.json" "$at/model-00001-of-00003.safetensors" "$tmp/"
    for f in model-00002-of-00003.safetensors model-00003-of-00003.safetensors; do cat "$at/$f".part* > "$tmp/$f"; done
    cp "$ASSETS/model.safetensors.index.json" "$ASSETS"/tokenizer* "$tmp/"
    chmod u+w "$tmp"/*
    rm -rf "$out" && mv "$tmp" "$out"
    if [ -f "$at/logs.tgz" ]; then tar xzf "$at/logs.tgz" -C "$(dirname "$out")"; fi
    echo "collected: $out (logs in $(dirname "$out")/logs)" >&2 ;;
  *) usage ;;
esac
