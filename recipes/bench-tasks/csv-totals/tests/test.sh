#!/bin/bash
set -u
expected='region,total
east,1015.00
north,500.00
south,350.00
west,100.00'
actual=$(tr -d '\r' < totals.csv)
if [ "$actual" = "$expected" ]; then echo PASS; else echo "totals.csv is:"; echo "$actual"; exit 1; fi
