#!/bin/bash
# step: list the files
find notes -type f | sort
# step: rename
find notes -type f -name '*.txt' -exec sh -c 'mv "$1" "${1%.txt}.md"' _ {} \;
