#!/bin/bash
# Builds the archive (kept out of the repository as a binary file).
set -e
mkdir -p build/project-x/src build/project-x/config/deploy build/project-x/docs
echo 'print("hello")' > build/project-x/src/main.py
echo '{"name": "decoy", "release": "0.0.1"}' > build/project-x/config/defaults.json
printf '{\n  "name": "project-x",\n  "version": "4.17.2",\n  "debug": false\n}\n' > build/project-x/config/deploy/settings.json
echo '# Project X' > build/project-x/docs/README.md
tar -czf bundle.tar.gz -C build project-x
rm -rf build
