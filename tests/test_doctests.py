"""Every docstring example in ``keepalive/`` runs, so the examples a newcomer copies stay true.

One test per module whose source holds ``>>>``: the module is imported (skipped, with the reason, when
the framework it needs is not installed) and its examples are run with :mod:`doctest`. Examples
marked ``# doctest: +SKIP`` (a Colab path, a model the example does not build) stay skipped; every
other one must pass, and a module with ``>>>`` whose examples doctest cannot find (an example in a
comment or in a nested function's docstring) fails, since it would silently never run.
"""
from __future__ import annotations

import doctest
import gc
import importlib
import io
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "keepalive")

# memory:// folders the examples write to: emptied around each module, so that an example that
# creates a run starts fresh however often the suite runs in one process
EXAMPLE_FOLDERS = ("/doc", "/doctest")


def _modules_with_examples():
    found = []
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                if ">>>" not in f.read():
                    continue
            rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            found.append(".".join(rel))
    return found


MODULES = _modules_with_examples()


def _forget_example_folders():
    import fsspec

    fs = fsspec.filesystem("memory")
    for path in EXAMPLE_FOLDERS:
        if fs.exists(path):
            fs.rm(path, recursive=True)


def test_the_modules_with_examples_are_found():
    # the examples the issue names: if these move, move them here too
    for name in ("keepalive.callbacks.torch", "keepalive.store", "keepalive.settings", "keepalive.report",
                 "keepalive.units"):
        assert name in MODULES, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, monkeypatch):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing and missing != "keepalive":
            pytest.skip(f"{name} needs {missing}, which is not installed")
        raise
    # the examples show what a user sees with the defaults: no verbosity from the environment
    monkeypatch.delenv("KEEPALIVE_VERBOSITY", raising=False)
    from keepalive import report

    report.reset_once("doctest")  # keys of once-only warnings shown by examples start with "doctest"
    tests = [t for t in doctest.DocTestFinder(exclude_empty=True).find(module, name) if t.examples]
    assert tests, f"{name} contains '>>>' but doctest finds no example in its docstrings"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    out = io.StringIO()
    _forget_example_folders()
    try:
        for test in tests:
            runner.run(test, out=out.write)
    finally:
        _forget_example_folders()
        gc.collect()  # the examples' objects (a checkpointer registers itself weakly) go now
    failed, attempted = runner.summarize(verbose=False)  # +SKIP examples are not attempted
    assert failed == 0, f"{failed} of {attempted} examples failed:\n{out.getvalue()}"
    if attempted == 0:
        pytest.skip(f"every example of {name} is marked +SKIP")
