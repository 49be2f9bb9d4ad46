#!/bin/bash
# step: record the output and find the uses
python3 main.py; grep -rnw area --include='*.py' .
# step: rename calls, the definition, imports and __all__ (not the word "area" in strings, not total_area)
grep -rlw area --include='*.py' . | xargs sed -i -E 's/\barea\(/rectangle_area(/g; s/(import .*)\barea\b/\1rectangle_area/; s/"area"/"rectangle_area"/g'
# step: check the output did not change
python3 main.py && grep -rnw area --include='*.py' .
