#!/bin/bash
# step: look at the format
head -5 app.log
# step: count ERROR lines per service
awk '$3 == "ERROR" { gsub(/[][]/, "", $4); n[$4]++ } END { for (s in n) print s, n[s] }' app.log | sort -k2,2nr -k1,1 > errors.txt
cat errors.txt
