#!/bin/bash
# step: count words
tr 'A-Z' 'a-z' < poem.txt | tr -cs 'a-z' '\n' | grep -v '^$' | sort | uniq -c | sort -k1,1nr -k2,2 | head -3 | awk '{print $1, $2}' > top3.txt
# step: check
cat top3.txt
