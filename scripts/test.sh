#!/usr/bin/env bash
# Install everything the tests need into .venv (created if missing), lint and type-check, run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# --quick runs the quick tier instead of the whole suite: the unit tests, the state machine, store and
# state, architecture, doctests and one crash test per adapter (listed in tests/conftest.py, about 5
# minutes on 2 cores). Every other argument goes to pytest.
quick=0
args=()
for arg in "$@"; do
  if [ "$arg" = "--quick" ]; then quick=1; else args+=("$arg"); fi
done
if [ "$quick" = 1 ]; then args=(-m quick ${args[@]+"${args[@]}"}); fi
bash scripts/setup-venv.sh test,keras,fastai,transformers,peft,lightning,jax
# tests/test_browser.py drives JupyterLab in Debian's headless chromium through chromedriver (Selenium):
# install both when missing (about 15 s; the test is skipped, with its reason, where they cannot be).
# The quick tier does not run it.
if [ "$quick" = 0 ] && { ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; }; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
  echo "installing chromium and chromium-driver (apt-get) for tests/test_browser.py"
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
      --no-install-recommends chromium chromium-driver; } >/dev/null 2>&1 \
    || echo "could not install chromium; tests/test_browser.py will be skipped"
fi
# A kernelspec inside the venv, so notebook tests start kernels with this interpreter.
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null 2>&1
# Lint and type-check first (configured in pyproject.toml): a violation fails the command.
echo "ruff check keepalive tests benchmarks"
.venv/bin/python -m ruff check --no-cache keepalive tests benchmarks
echo "mypy keepalive"
.venv/bin/python -m mypy keepalive
# The documentation site (mkdocs.yml): a broken link, a page missing from the nav or an API page that
# cannot be rendered fails the command. Built into a temporary folder, never into the checkout.
echo "mkdocs build --strict"
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
# The files run on one process per core (2 on CI), each file whole on one process (--dist loadfile:
# a file's module fixtures, such as its uninterrupted reference trainings, are computed once).
# KEEPALIVE_TEST_PROCESSES=1 (or passing -p no:xdist) runs them in this process, one after another.
procs="${KEEPALIVE_TEST_PROCESSES:-$(nproc 2>/dev/null || echo 2)}"
[ "$procs" -gt 4 ] && procs=4
if [ "$procs" -gt 1 ]; then
  exec .venv/bin/python -m pytest -q -rs -n "$procs" --dist loadfile ${args[@]+"${args[@]}"}
fi
exec .venv/bin/python -m pytest -q -rs ${args[@]+"${args[@]}"}
