#!/bin/bash
set -u
python3 - <<'PY'
import sys
sys.path.insert(0, ".")
from wordcount import count_words

cases = {"": 0, "one": 1, "a  b\nc": 3, "  lead and trail  ": 3, "\t\n": 0, "x\ty\r\nz": 3,
         "héllo wörld": 2}
for text, expected in cases.items():
    assert count_words(text) == expected, (text, count_words(text), expected)
PY
[ $? -eq 0 ] || exit 1
[ "$(python3 wordcount.py sample.txt)" = "9" ] || { echo "wordcount.py sample.txt does not print 9"; exit 1; }
echo PASS
