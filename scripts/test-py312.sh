#!/usr/bin/env bash
# The quick tier (tests/conftest.py QUICK_FILES / QUICK_TESTS) on Python 3.12, Colab's Python, in
# .venv312. Without the frameworks: the registries here hold torch 2.13.0 for 3.12 only as the CUDA
# build (a 527 MB wheel that needs GBs of nvidia-* packages), the CPU wheel only for 3.11, so this runs
# keepalive's framework-free part (state machine, store, state, settings, architecture, doctests,
# the bytecode reading of `break`); the test files that import torch at their top are left out, and
# listed. PYTHON312=/path/to/python3.12 picks the interpreter; other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON312:-$(command -v python3.12 || echo /root/.pyenv/versions/3.12.1/bin/python3.12)}"
if [ ! -x .venv312/bin/python ]; then
  "$py" -m venv .venv312
fi
stamp=.venv312/.keepalive-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  # the test extra minus torch and the frameworks (constraints.txt pins what it names)
  .venv312/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e . \
    "pytest>=8" pytest-timeout pytest-xdist safetensors "ipython>=8" gcsfs s3fs "moto[server]" \
    gcp-storage-emulator
  touch "$stamp"
fi
.venv312/bin/python --version
ignore=()
left_out=()
for f in tests/test_*.py; do
  if grep -qE '^(import|from) (torch|safetensors\.torch|keras|tensorflow|fastai|transformers|lightning)\b' "$f"; then
    ignore+=(--ignore "$f")
    left_out+=("$(basename "$f")")
  fi
done
echo "left out (they import a framework at their top): ${left_out[*]}"
procs="${KEEPALIVE_TEST_PROCESSES:-$(nproc 2>/dev/null || echo 2)}"
[ "$procs" -gt 4 ] && procs=4
exec .venv312/bin/python -m pytest -q -rs -m quick -n "$procs" --dist loadfile -p no:cacheprovider \
  "${ignore[@]}" "$@"
