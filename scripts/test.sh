#!/usr/bin/env bash
# Install everything the tests need into .venv (created if missing), lint and type-check, run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh test,keras,fastai
# A kernelspec inside the venv, so notebook tests start kernels with this interpreter.
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null 2>&1
# Lint and type-check first (configured in pyproject.toml): a violation fails the command.
echo "ruff check keepalive tests benchmarks"
.venv/bin/python -m ruff check --no-cache keepalive tests benchmarks
echo "mypy keepalive"
.venv/bin/python -m mypy keepalive
exec .venv/bin/python -m pytest -q -rs "$@"
