#!/bin/bash
set -u
python3 - <<'PY'
import re
from collections import Counter

words = re.findall(r"[a-z]+", open("/tests/poem.txt", encoding="utf-8").read().lower())
counts = Counter(words)
top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
expected = "".join(f"{n} {w}\n" for w, n in top)
actual = open("top3.txt", encoding="utf-8").read()
assert actual.strip() == expected.strip(), f"expected:\n{expected}got:\n{actual}"
print("PASS")
PY
