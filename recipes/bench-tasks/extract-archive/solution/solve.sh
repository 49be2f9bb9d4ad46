#!/bin/bash
# step: extract
mkdir -p unpacked && tar -xzf bundle.tar.gz -C unpacked
# step: find the settings
find unpacked -name settings.json
# step: read the version
python3 -c 'import json, glob; print(json.load(open(glob.glob("unpacked/**/settings.json", recursive=True)[0]))["version"])' > version.txt
cat version.txt
