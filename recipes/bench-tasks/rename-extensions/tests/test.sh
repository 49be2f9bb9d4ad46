#!/bin/bash
set -u
expected='notes/alpha.md:first note
notes/archive/2023/data.csv:a.txt is a name inside
notes/archive/2023/delta.md:older
notes/archive/epsilon.md:already markdown
notes/archive/gamma.md:old one
notes/beta.md:second note
notes/readme.rst:keep me'
actual=$(find notes -type f | LC_ALL=C sort | while read -r f; do printf '%s:%s\n' "$f" "$(cat "$f")"; done)
if [ "$actual" = "$expected" ]; then echo PASS; else echo "unexpected files:"; echo "$actual"; exit 1; fi
