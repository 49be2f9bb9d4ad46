#!/usr/bin/env bash
# pip's install of the dev extras with and without compiling what it installs, each into a fresh venv of a clean
# clone, then the first and second import of torch and the model where bytecode is written as modules are imported
# (PYTHONDONTWRITEBYTECODE unset, as .ci/run runs the tests). Run from the repository root: bash THIS_FILE
set -eu
src=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
secs() { local s e; s=$(date +%s.%N); "$@"; e=$(date +%s.%N); echo "$e - $s" | bc; }
for mode in default no-compile; do
  git clone -q "$src" "$work/$mode" && cd "$work/$mode" && python3 -m venv .venv
  flags=(-q -e ".[dev]"); [ "$mode" = no-compile ] && flags=(-q --no-compile -e ".[dev]")
  echo "pip install, $mode: $(secs .venv/bin/pip install "${flags[@]}" 2>/dev/null) s"
done
cd "$work/no-compile"
echo "first import, writing bytecode: $(secs env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c 'import torch, dsv41.model.transformer') s"
echo "second import: $(secs env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c 'import torch, dsv41.model.transformer') s"
