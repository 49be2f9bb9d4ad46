#!/bin/bash
set -u
expected='alice.smith@example.com
bob+news@mail.example.org
carol_99@corp-mail.net
frank.o-neil@sub.domain.co.uk'
actual=$(cat emails.txt)
if [ "$actual" = "$expected" ]; then echo PASS; else echo "emails.txt is:"; echo "$actual"; exit 1; fi
