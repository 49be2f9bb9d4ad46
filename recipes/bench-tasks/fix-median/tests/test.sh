#!/bin/bash
set -u
python3 - <<'PY'
import random
import statistics
import sys

sys.path.insert(0, ".")
from stats import mean, median

cases = [[3, 1, 2], [1, 2, 3, 4], [5], [2, 2], [-1, 10, 4, 7], [0.5, 0.25]]
rng = random.Random(7)
cases += [[rng.randint(-50, 50) for _ in range(rng.randint(1, 12))] for _ in range(200)]
for values in cases:
    copy = list(values)
    got = median(values)
    assert values == copy, "median must not reorder its argument"
    assert abs(got - statistics.median(values)) < 1e-12, (values, got)
assert mean([1, 2, 3]) == 2
print("PASS")
PY
