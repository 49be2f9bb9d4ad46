#!/bin/bash
set -u
expected='ana: 81.5
bo: 71.0
cy: 97.5'
[ -f report/make_report.py ] || { echo "report/make_report.py is missing"; exit 1; }
[ "$(cat report/summary.txt)" = "$expected" ] || { echo "summary.txt is:"; cat report/summary.txt; exit 1; }
# the script must compute, not just print: run it on other data
mkdir -p /tmp/check/data /tmp/check/report
printf 'name,subject,score\nzed,art,10\nyan,art,3\nzed,music,15\n' > /tmp/check/data/scores.csv
cp report/make_report.py /tmp/check/report/
out=$(cd /tmp/check && python3 report/make_report.py)
[ "$out" = "$(printf 'yan: 3.0\nzed: 12.5')" ] || { echo "make_report.py printed on other data:"; echo "$out"; exit 1; }
echo PASS
