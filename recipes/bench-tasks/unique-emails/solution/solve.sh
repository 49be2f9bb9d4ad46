#!/bin/bash
grep -oE '[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}' server.log | tr 'A-Z' 'a-z' | LC_ALL=C sort -u > emails.txt
cat emails.txt
