#!/usr/bin/env bash
# The GPU machine (Python 3.12, torch 2.11) may lack Pillow, which the picture generator of the vision
# data (recipes/tiny/vision/data.py) needs. This packs a trimmed Pillow for it into DATA/pil312.tar.xz
# (2.5 MB: the wheel minus the AVIF/WebP/LCMS codecs the generator never uses, to fit the device's
# 64 MiB transfer limit). On the device: tar xJf DATA/pil312.tar.xz -C /tmp/pylib; PYTHONPATH=/tmp/pylib:.
#   bash recipes/tiny/pack_device_deps.sh [DATA]      (default .tinydata; needs network once)
set -euo pipefail
DATA=${1:-.tinydata}
WORK=$(mktemp -d)
python3 -m pip download -q pillow==11.3.0 --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --no-deps -d "$WORK"
(cd "$WORK" && python3 -m zipfile -e pillow-*.whl x)
cd "$WORK/x"
rm -rf pillow.libs/libavif* pillow.libs/libwebp* pillow.libs/libsharpyuv* pillow.libs/liblcms2* \
    PIL/_avif* PIL/_webp* PIL/_imagingcms* PIL/_imagingtk* PIL/_imagingmorph* ./*.dist-info
tar cJf "$OLDPWD/$DATA/pil312.tar.xz" PIL pillow.libs
echo "wrote $DATA/pil312.tar.xz"
