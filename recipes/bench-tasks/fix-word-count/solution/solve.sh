#!/bin/bash
# step: see the bug
python3 wordcount.py sample.txt
# step: split on any whitespace
sed -i 's/return len(text.split(" "))/return len(text.split())/' wordcount.py && python3 wordcount.py sample.txt
