#!/bin/bash
set -u
expected='auth 3
billing 2
mailer 1
search 1'
actual=$(sed 's/[[:space:]]*$//' errors.txt)
if [ "$actual" = "$expected" ]; then echo PASS; else echo "errors.txt is:"; echo "$actual"; exit 1; fi
