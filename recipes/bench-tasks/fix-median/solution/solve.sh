#!/bin/bash
# step: reproduce
python3 check.py
# step: fix the even case
python3 - <<'PY'
from pathlib import Path
path = Path("stats.py")
source = path.read_text()
source = source.replace(
    "    return ordered[middle]\n",
    "    if len(ordered) % 2:\n"
    "        return ordered[middle]\n"
    "    return (ordered[middle - 1] + ordered[middle]) / 2\n",
)
path.write_text(source)
PY
# step: verify
python3 check.py
