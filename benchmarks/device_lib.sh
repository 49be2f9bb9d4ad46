# Shared by the device batch scripts (source it from the repository root after setting OUT and PY):
# the environment they all want, `step` (a command under a time limit, logged), `record_env`.
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET DSV41_DISABLE_TRITON
mkdir -p "$OUT"
start=$(date +%s)

step() {  # step NAME SECONDS command...: run with a time limit, log to $OUT/NAME.log, report the exit code
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc$( [ $rc = 124 ] && echo ' (time limit)') after $(( $(date +%s) - start )) s" | tee -a "$OUT/steps.txt"
}

record_env() {  # the machine, the software and the commit -> $OUT/env.txt (extra lines from the arguments)
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv 2>&1
    "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)" 2>&1
    for line in "$@"; do echo "$line"; done
    git rev-parse HEAD 2>/dev/null
    git status --short 2>/dev/null | head -20
  } > "$OUT/env.txt"
}
