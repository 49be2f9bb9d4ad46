#!/bin/bash
set -u
printf 'name,city\nAda,London\nLinus,Helsinki\n' | cmp -s - data/people.txt || { echo "people.txt is wrong"; cat -A data/people.txt; exit 1; }
printf 'first line\n\n  indented line\nlast line' > /tmp/notes.expected
printf 'first line\n\n  indented line\nlast line\n' > /tmp/notes.expected2
cmp -s /tmp/notes.expected data/notes.txt || cmp -s /tmp/notes.expected2 data/notes.txt || { echo "notes.txt is wrong"; cat -A data/notes.txt; exit 1; }
printf 'binary\r\nstays  \r\n' | cmp -s - data/keep.bin || { echo "keep.bin was changed"; exit 1; }
echo PASS
