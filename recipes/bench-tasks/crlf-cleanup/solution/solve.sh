#!/bin/bash
# step: see the line endings
cat -A data/*.txt
# step: strip CR and trailing blanks
sed -i 's/\r$//; s/[[:space:]]*$//' data/*.txt && cat -A data/*.txt
