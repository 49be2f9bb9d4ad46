#!/usr/bin/env bash
# System packages that scaffold-bench and its tests need on Debian:
#   bubblewrap  the jail every model-issued command runs in (evals/scaffolds/sandbox.py);
#   python3     /usr/bin/python3 inside the jail (the bundled tasks' tests and solutions use it).
# Idempotent: apt-get runs only when something is missing. Meant to be called from .ci/run as root.
set -euo pipefail
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
[ -x /usr/bin/python3 ] || missing+=(python3)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "deps-scaffold: need root to install: ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
bwrap --version
