#!/bin/bash
set -u
expected='aki
bodo
mara'
[ "$(cat active.txt)" = "$expected" ] || { echo "active.txt is:"; cat active.txt; exit 1; }
echo PASS
