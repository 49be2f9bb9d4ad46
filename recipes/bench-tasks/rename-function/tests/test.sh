#!/bin/bash
set -u
out=$(python3 main.py) || { echo "main.py fails"; exit 1; }
expected=$(printf 'first room: 12 perimeter 14\ntotal area: 27.0')
[ "$out" = "$expected" ] || { echo "main.py printed:"; echo "$out"; exit 1; }
python3 - <<'PY'
import ast, pathlib, sys
bad = []
for path in pathlib.Path(".").rglob("*.py"):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "area":
            bad.append(f"{path}: def area")
        elif isinstance(node, ast.Name) and node.id == "area":
            bad.append(f"{path}:{node.lineno}: name area")
        elif isinstance(node, ast.alias) and node.name == "area":
            bad.append(f"{path}: import area")
        elif isinstance(node, ast.Constant) and node.value == "area":
            bad.append(f"{path}: '__all__' still lists area")
sys.path.insert(0, ".")
import geometry.shapes
if not hasattr(geometry.shapes, "rectangle_area") or geometry.shapes.rectangle_area(2, 3) != 6:
    bad.append("geometry.shapes.rectangle_area missing or wrong")
from geometry.rooms import total_area
if total_area([(1, 2)]) != 2:
    bad.append("total_area broken")
if bad:
    print("\n".join(bad)); sys.exit(1)
print("PASS")
PY
