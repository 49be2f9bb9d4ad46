#!/bin/bash
# Pass iff greeting.txt holds exactly "Hello, sandbox!\n".
set -u
[ -f greeting.txt ] || { echo "greeting.txt is missing"; exit 1; }
printf 'Hello, sandbox!\n' | cmp -s - greeting.txt || { echo "greeting.txt has the wrong content:"; cat -A greeting.txt | head -5; exit 1; }
echo PASS
