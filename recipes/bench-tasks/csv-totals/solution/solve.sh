#!/bin/bash
# step: inspect
head -3 sales.csv
# step: sum per region
{ echo "region,total"; awk -F, 'NR > 1 { sum[$1] += $3 } END { for (r in sum) printf "%s,%.2f\n", r, sum[r] }' sales.csv | LC_ALL=C sort; } > totals.csv
cat totals.csv
