"""The layers of ``keepalive/`` (README, "Architecture"), enforced by reading every module's imports.

A module may import only from its own layer or a lower one, not even lazily inside a function: that
is what lets a newcomer read the tree bottom-up as the data flow, and what keeps the core free of
notebook machinery. Every module under ``keepalive/`` is parsed with :mod:`ast` (nothing is
imported); its imports of keepalive modules are collected, absolute and relative, top-level and
inside functions, plus ``importlib.import_module("keepalive...")`` and ``sys.modules["keepalive..."]``
look-ups (reaching up through ``sys.modules`` is still reaching up). Each test lists every violation
it finds, not only the first.

A module of a package takes the package's layer (``keepalive/session/clock.py`` is ``session``). A new
module must be added to :data:`LAYERS` (and to the README's table).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "keepalive")

#: top-level module or package of keepalive -> layer (0: imports nothing of keepalive above it)
LAYERS: Dict[str, int] = {
    # 0 base
    "_version": 0, "units": 0, "errors": 0, "settings": 0, "report": 0,
    # 1 storage
    "backends": 1, "state": 1, "store": 1, "rng": 1, "dataorder": 1,
    # 2 runs
    "spool": 2, "writer": 2, "resume": 2, "runs": 2, "dcp": 2,
    # 3 session
    "session": 3, "trigger": 3, "progress": 3, "notebook": 3, "distributed": 3,
    # 4 core
    "config": 4, "core": 4, "adapter": 4, "status": 4,
    # 5 adapters
    "callbacks": 5,
    # 6 shells; the package itself (`keepalive/__init__.py` loads the IPython extension on demand)
    # and `python -m keepalive` are entry points like the CLI
    "magics": 6, "cli": 6, "workloads": 6, "__main__": 6, "__init__": 6,
}
LAYER_NAMES = {0: "base", 1: "storage", 2: "runs", 3: "session", 4: "core", 5: "adapters", 6: "shells"}
SHELLS = 6

NOTEBOOK_PACKAGES = {"IPython", "ipykernel", "ipywidgets", "jupyter_client", "traitlets"}
FRAMEWORKS = ("torch", "tensorflow", "keras", "fastai", "IPython")


# ------------------------------------------------------------------------------------ reading
@dataclass(frozen=True)
class Module:
    name: str        # keepalive.callbacks.fastai
    path: str        # keepalive/callbacks/fastai.py (relative to the repository)
    is_package: bool  # an __init__.py

    @property
    def key(self) -> str:
        """The entry of :data:`LAYERS` this module belongs to."""
        parts = self.name.split(".")
        return "__init__" if len(parts) == 1 else parts[1]


@dataclass(frozen=True)
class Import:
    source: Module
    line: int
    target: str              # the module imported, absolute (keepalive.core, IPython.display)
    names: Tuple[str, ...]   # the names taken from it (``from target import a, b``); () for a module
    lazy: bool               # inside a function
    alias: Optional[str] = None  # the local name bound to a module (``from . import torch as t``)

    def where(self) -> str:
        return f"{self.source.path}:{self.line}" + (" (inside a function)" if self.lazy else "")


def _modules() -> List[Module]:
    found = []
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for file in sorted(files):
            if not file.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, file), ROOT)
            parts = rel[:-3].split(os.sep)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found.append(Module(".".join(parts), rel, is_package))
    return found


MODULES = _modules()
KNOWN = {m.name for m in MODULES} | {
    os.path.relpath(folder, ROOT).replace(os.sep, ".") for folder, _, _ in os.walk(PACKAGE)
    if "__pycache__" not in folder}


def _literal(node: ast.AST) -> Optional[str]:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dynamic_target(node: ast.AST) -> Optional[str]:
    """The module named by ``importlib.import_module("x")``, ``__import__("x")``,
    ``sys.modules["x"]`` or ``sys.modules.get("x")``."""
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in ("import_module", "__import__"):
            return _literal(node.args[0])
        if (name == "get" and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute)
                and func.value.attr == "modules"):
            target = _literal(node.args[0])
            return target if target and target.startswith("keepalive") else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
            and node.value.attr == "modules":
        target = _literal(node.slice)
        return target if target and target.startswith("keepalive") else None
    return None


def _parse(module: Module) -> ast.Module:
    with open(os.path.join(ROOT, module.path), encoding="utf-8") as f:
        return ast.parse(f.read(), module.path)


def _imports(module: Module, tree: Optional[ast.Module] = None) -> Iterator[Import]:
    tree = _parse(module) if tree is None else tree
    lazy_nodes: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lazy_nodes.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        lazy = id(node) in lazy_nodes
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, node.lineno, alias.name, (), lazy, alias.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.name.split(".")
                if not module.is_package:
                    package = package[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            taken = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                # `from . import store`: the module keepalive.store (also one of the table not written yet)
                if sub in KNOWN or (base == "keepalive" and alias.name in LAYERS):
                    yield Import(module, node.lineno, sub, (), lazy, alias.asname or alias.name)
                else:
                    taken.append(alias.name)
            if taken:
                yield Import(module, node.lineno, base, tuple(taken), lazy)
        else:
            target = _dynamic_target(node)
            if target:
                yield Import(module, node.lineno, target, (), lazy)


IMPORTS: List[Import] = [imp for m in MODULES for imp in _imports(m)]


def _key(target: str) -> Optional[str]:
    """The :data:`LAYERS` entry of a keepalive module name, None for other packages."""
    parts = target.split(".")
    if parts[0] != "keepalive":
        return None
    return "__init__" if len(parts) == 1 else parts[1]


def _layer(key: Optional[str]) -> Optional[int]:
    return LAYERS.get(key) if key is not None else None


def _describe(key: str) -> str:
    layer = LAYERS[key]
    return f"layer {layer} {LAYER_NAMES[layer]}"


def _fail(what: str, violations: List[str]) -> None:
    if violations:
        pytest.fail(f"{len(set(violations))} {what}:\n  " + "\n  ".join(sorted(set(violations))),
                    pytrace=False)


# ------------------------------------------------------------------------------------- tests
def test_the_reader_sees_every_kind_of_import():
    """The reader on a made-up module: relative and absolute, top-level and lazy, dynamic."""
    source = ("import os\nfrom .. import core\nfrom ..store import CheckpointStore as S\n"
              "import keepalive.cli\nimport importlib, sys\n"
              "def f():\n    from ..magics import widget\n    from .torch import _own\n"
              "    importlib.import_module('keepalive.workloads')\n"
              "    return sys.modules['keepalive.spool']\n")
    fake = Module("keepalive.callbacks.probe", "keepalive/callbacks/probe.py", False)
    got = {(i.target, i.names, i.lazy) for i in _imports(fake, ast.parse(source))}
    assert ("keepalive.core", (), False) in got
    assert ("keepalive.store", ("CheckpointStore",), False) in got
    assert ("keepalive.cli", (), False) in got and ("os", (), False) in got
    assert ("keepalive.magics.widget", (), True) in got
    assert ("keepalive.callbacks.torch", ("_own",), True) in got
    assert ("keepalive.workloads", (), True) in got and ("keepalive.spool", (), True) in got


def test_every_module_has_a_layer():
    unknown = [f"{m.path}: {m.key!r} is not in LAYERS (tests/test_architecture.py) nor in the README's "
               "Architecture table" for m in MODULES if m.key not in LAYERS]
    _fail("modules without a layer", unknown)


def test_no_module_imports_from_a_higher_layer():
    violations = []
    for imp in IMPORTS:
        key = _key(imp.target)
        mine, theirs = _layer(imp.source.key), _layer(key)
        if key is None or mine is None or theirs is None or theirs <= mine:
            continue
        what = imp.target + (f" ({', '.join(imp.names)})" if imp.names else "")
        violations.append(f"{imp.where()}: {imp.source.name} ({_describe(imp.source.key)}) imports "
                          f"{what} ({_describe(key)})")
    _fail("imports from a higher layer", violations)


def test_nothing_below_the_shells_imports_ipython():
    """The core and everything it stands on run in a plain Python process: no IPython, not even in a
    function (the notebook cell capture in ``notebook.py`` looks the kernel up without importing)."""
    violations = [f"{imp.where()}: {imp.source.name} ({_describe(imp.source.key)}) imports {imp.target}"
                  for imp in IMPORTS
                  if imp.target.split(".")[0] in NOTEBOOK_PACKAGES
                  and (_layer(imp.source.key) or 0) < SHELLS]
    _fail("notebook imports below the shells", violations)


def test_core_imports_no_ipython():
    core = [m for m in MODULES if m.name == "keepalive.core"]
    assert core, "keepalive/core.py is gone: update this test"
    violations = [f"{imp.where()}: imports {imp.target}" for imp in IMPORTS
                  if imp.source.name == "keepalive.core" and imp.target.split(".")[0] in NOTEBOOK_PACKAGES]
    _fail("IPython imports in keepalive/core.py", violations)


def test_importing_keepalive_imports_no_framework_and_no_ipython():
    code = ("import sys, keepalive\n"
            f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"`import keepalive` imported {out.stdout.strip()}"


def test_workloads_are_imported_by_the_cli_only():
    """The benchmark workloads sit outside the core import graph: only ``keepalive bench`` uses them."""
    allowed = {"keepalive.cli"}
    violations = [f"{imp.where()}: {imp.source.name} imports {imp.target}" for imp in IMPORTS
                  if _key(imp.target) == "workloads" and imp.source.key != "workloads"
                  and imp.source.name not in allowed]
    _fail("imports of keepalive.workloads outside the CLI", violations)


def test_adapters_do_not_import_each_others_privates():
    """``from .torch import _own`` in ``callbacks/fastai.py`` couples two adapters through a detail
    one of them may change: what adapters share lives in a public helper (or in the core)."""
    violations = []
    callbacks = [i for i in IMPORTS if i.source.key == "callbacks" and _key(i.target) == "callbacks"
                 and i.target not in (i.source.name, "keepalive.callbacks")]
    for imp in callbacks:
        private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
        if private:
            violations.append(f"{imp.where()}: {imp.source.name} imports {', '.join(private)} "
                              f"from {imp.target}")
    # `from . import torch as t` ... `t._own`: the private reached through the module
    by_source: Dict[Module, Dict[str, str]] = {}
    for imp in callbacks:
        if not imp.names and imp.alias:
            by_source.setdefault(imp.source, {})[imp.alias] = imp.target
    for module, aliases in by_source.items():
        for node in ast.walk(_parse(module)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                violations.append(f"{module.path}:{node.lineno}: {module.name} uses "
                                  f"{aliases[node.value.id]}.{node.attr}")
    _fail("adapter imports of another adapter's privates", violations)


def _environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _keepalive_variable(node: ast.AST) -> Optional[str]:
    name = _literal(node)
    return name if name and name.startswith("KEEPALIVE_") else None


def test_keepalive_variables_are_read_through_settings():
    """Every ``KEEPALIVE_*`` variable is parsed in one place, ``keepalive/settings.py`` (its table holds
    the default and the meaning): no module reads one from ``os.environ`` itself. Setting one (the
    ``%keepalive dir`` magic does) is fine."""
    violations = []
    for module in MODULES:
        if module.name == "keepalive.settings":
            continue
        for node in ast.walk(_parse(module)):
            name = None
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr == "get" and _environ(func.value):
                    name = _keepalive_variable(node.args[0])
                elif getattr(func, "attr", getattr(func, "id", None)) == "getenv":
                    name = _keepalive_variable(node.args[0])
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _environ(node.value):
                name = _keepalive_variable(node.slice)
            elif isinstance(node, ast.Compare) and any(_environ(c) for c in node.comparators) \
                    and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                name = _keepalive_variable(node.left)
            if name:
                violations.append(f"{module.path}:{node.lineno}: reads {name} from the environment; use "
                                  f"keepalive.settings.get({name!r})")
    _fail("KEEPALIVE_* variables read outside keepalive/settings.py", violations)
