#!/bin/bash
# step: create the directory and the script
mkdir -p report && cat > report/make_report.py <<'PY'
import csv
from collections import defaultdict

totals = defaultdict(list)
with open("data/scores.csv", newline="") as f:
    for row in csv.DictReader(f):
        totals[row["name"]].append(float(row["score"]))
for name in sorted(totals):
    scores = totals[name]
    print(f"{name}: {sum(scores) / len(scores):.1f}")
PY
# step: run it
python3 report/make_report.py > report/summary.txt
# step: check
cat report/summary.txt
