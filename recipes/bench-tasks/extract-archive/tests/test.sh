#!/bin/bash
set -u
[ -f bundle.tar.gz ] || { echo "bundle.tar.gz was removed"; exit 1; }
[ -f unpacked/project-x/config/deploy/settings.json ] || { echo "the archive was not extracted into unpacked/"; exit 1; }
[ "$(cat version.txt)" = "4.17.2" ] || { echo "version.txt holds: $(cat version.txt)"; exit 1; }
echo PASS
