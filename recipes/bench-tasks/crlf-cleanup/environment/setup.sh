#!/bin/bash
# Builds the Windows-style files (kept out of the repository so they stay byte-exact).
set -e
mkdir -p data
printf 'name,city  \r\nAda,London\t\r\nLinus,Helsinki\r\n' > data/people.txt
printf 'first line \r\n\r\n  indented line\t \r\nlast line' > data/notes.txt
printf 'binary\r\nstays  \r\n' > data/keep.bin
