#!/usr/bin/env bash
# Install everything the tests need into .venv (created if missing) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh test,keras,fastai
# A kernelspec inside the venv, so notebook tests start kernels with this interpreter.
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null 2>&1
exec .venv/bin/python -m pytest -q -rs "$@"
