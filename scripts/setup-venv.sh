#!/usr/bin/env bash
# Create (or reuse) .venv in the repo root and install keepalive with the given extras.
# torch is pinned by constraints.txt: an unpinned torch pulls GBs of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-torch}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=".venv/.keepalive-installed-$extras"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[$extras]"
  touch "$stamp"
fi
