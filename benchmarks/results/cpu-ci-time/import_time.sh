#!/usr/bin/env bash
# Import of the CLI, engine, model and bpb modules, best 3 of 5 wall times, with the project's bytecode
# compiled and then without it (PYTHONDONTWRITEBYTECODE=1 keeps Python from writing it on the way). Run from the
# repository root: bash benchmarks/results/cpu-ci-time/import_time.sh
set -eu
times() {
  for _ in 1 2 3 4 5; do
    /usr/bin/time -f "%e" .venv/bin/python -c \
      "import dsv41_cli.app, dsv41.model.engine, dsv41.model.transformer, dsv41.evals.bpb" 2>&1 | tail -1
  done | sort -n | head -3 | tr '\n' ' '
}
export PYTHONDONTWRITEBYTECODE=1
.venv/bin/python -m compileall -q dsv41 dsv41_cli model evals recipes serve >/dev/null
echo "compiled: $(times)"
find dsv41 dsv41_cli model evals recipes serve -name __pycache__ -type d -prune -exec rm -rf {} +
echo "not compiled: $(times)"
