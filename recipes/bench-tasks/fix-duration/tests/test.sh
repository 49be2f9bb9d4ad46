#!/bin/bash
set -u
python3 - <<'PY'
import sys
sys.path.insert(0, ".")
from duration import parse_duration

cases = {"1h30m": 5400, "45s": 45, "2h5m10s": 7510, "90m": 5400, "0s": 0, " 3h ": 10800, "1m1s": 61}
for text, expected in cases.items():
    assert parse_duration(text) == expected, (text, parse_duration(text), expected)
for bad in ("", "10", "5x", "1h 30m"):
    try:
        parse_duration(bad)
    except ValueError:
        continue
    raise AssertionError(f"{bad!r} should be rejected")
print("PASS")
PY
