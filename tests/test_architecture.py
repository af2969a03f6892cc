"""The layers of ``keepalive/`` (docs/architecture.md), enforced by reading every module's imports.

A module may import only from its own layer or a lower one, not even lazily inside a function: that
is what lets a newcomer read the tree bottom-up as the data flow, and what keeps the core free of
notebook machinery. Every module under ``keepalive/`` is parsed with :mod:`ast` (nothing is
imported); its imports of keepalive modules are collected, absolute and relative, top-level and
inside functions, plus ``importlib.import_module("keepalive...")`` and ``sys.modules["keepalive..."]``
look-ups (reaching up through ``sys.modules`` is still reaching up). Each test lists every violation
it finds, not only the first.

No two modules may import each other, directly or around a longer loop, even within one layer and
even lazily: the modules of a cycle can only be understood, tested and moved together, and a
function-level import that closes one only hides it. Imports under ``if TYPE_CHECKING:`` are left
out of that check (they never run). A cycle is broken by moving the piece both sides need into the
lower module, or by passing a value or a callable in, not by moving the import into a function.

A module of a package takes the package's layer (``keepalive/session/clock.py`` is ``session``). A new
module must be added to :data:`LAYERS` (and to the layer table of docs/architecture.md).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "keepalive")

#: top-level module or package of keepalive -> layer (0: imports nothing of keepalive above it)
LAYERS: Dict[str, int] = {
    # 0 base
    "_version": 0, "units": 0, "errors": 0, "settings": 0, "report": 0, "statetree": 0, "plan": 0,
    "loopstate": 0,  # the loop's own variables, read from its code (stdlib only: every adapter may use it)
    "memory": 0,  # the memory budget of a save's host copy (the VM's and the container's room)
    # 1 storage
    "backends": 1, "state": 1, "store": 1, "rng": 1, "dataorder": 1,
    "hoststream": 1,  # a save that streams the state through a bounded buffer (no full copy)
    # 2 runs
    "spool": 2, "writer": 2, "resume": 2, "runs": 2, "dcp": 2,
    "jaxgroup": 2,  # keepalive's collectives over jax.distributed's coordination service
    "runlog": 2,  # the run across sessions: each session's record (heartbeat, history) and the run's state
    # 3 session
    "session": 3, "trigger": 3, "progress": 3, "notebook": 3, "distributed": 3,
    "boundary": 3, "savepath": 3, "interrupts": 3,  # the boundary state machine, the save paths, deferred signals
    "rendezvous": 3,  # the restart-safe env:// rendezvous of torchrun workers (import keepalive installs it)
    "pauses": 3, "autointerval": 3,  # saves between steps (marks, the step gate, the guard); every="auto"
    "savecosts": 3,  # the saves of a fixed every= that cost too much of the training, told once
    "runidentity": 3,  # which run an unnamed checkpointer writes (an Optuna trial's own); the first save's line
    "notify": 3,  # messages through Apprise URLs, sent in the background (the training's events, `keepalive run`)
    "kagglechain": 3,  # opt-in: the next version of a Kaggle notebook pushed at the session's deadline
    "resumefrom": 3,  # resume_from=: another run folder (Kaggle's input copy) read, never written
    "endrecord": 0,  # how a supervised process ended (refused or crashed), for `keepalive run`
    "supervise": 4,  # `keepalive run -- CMD`: the command started again after a stop or a crash
    "runsummary": 3, "runchart": 3,  # a run across its sessions (keepalive report): the summary, the picture
    # 4 core
    "config": 4, "core": 4, "adapter": 4, "status": 4,
    "lifecycle": 4,  # the parts the core's Checkpointer is a facade over (boundaries, saves, pauses, ...)
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
    type_only: bool = False  # under ``if TYPE_CHECKING:`` (never executed)

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


def _type_checking(test: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: Module, tree: Optional[ast.Module] = None) -> Iterator[Import]:
    tree = _parse(module) if tree is None else tree
    lazy_nodes: Set[int] = set()
    type_only_nodes: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lazy_nodes.update(id(n) for n in ast.walk(node) if n is not node)
        elif isinstance(node, ast.If) and _type_checking(node.test):
            type_only_nodes.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        lazy = id(node) in lazy_nodes
        type_only = id(node) in type_only_nodes
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, node.lineno, alias.name, (), lazy, alias.asname, type_only)
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
                    yield Import(module, node.lineno, sub, (), lazy, alias.asname or alias.name, type_only)
                else:
                    taken.append(alias.name)
            if taken:
                yield Import(module, node.lineno, base, tuple(taken), lazy, None, type_only)
        else:
            target = _dynamic_target(node)
            if target:
                yield Import(module, node.lineno, target, (), lazy, None, type_only)


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


MODULE_NAMES = {m.name for m in MODULES}


def _module_of(target: str) -> Optional[str]:
    """The keepalive module an import target names: the longest module prefix of ``target``
    (``import keepalive.session.idle.x`` names ``keepalive.session.idle``), None outside keepalive."""
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in MODULE_NAMES:
            return name
        parts.pop()
    return None


Graph = Mapping[str, Mapping[str, List[Import]]]


def _graph(imports: List[Import]) -> Dict[str, Dict[str, List[Import]]]:
    """Module -> the keepalive modules it imports -> the imports that do it. Lazy imports count;
    ``TYPE_CHECKING`` ones and a module naming itself do not."""
    graph: Dict[str, Dict[str, List[Import]]] = {}
    for imp in imports:
        target = _module_of(imp.target)
        if imp.type_only or target is None or target == imp.source.name:
            continue
        graph.setdefault(imp.source.name, {}).setdefault(target, []).append(imp)
    return graph


def _strongly_connected(graph: Mapping[str, Mapping[str, object]]) -> List[List[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted, sorted."""
    nodes = sorted(set(graph) | {t for targets in graph.values() for t in targets})
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for root in nodes:
        if root in index:
            continue
        # iterative depth-first search: (node, iterator over its successors)
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, {})))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def _loop(graph: Mapping[str, Mapping[str, object]], component: List[str]) -> List[str]:
    """One shortest closed path through the component's first module: [a, b, ..., a]."""
    start, members = component[0], set(component)
    previous: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, {})):
                if nxt not in members:
                    continue
                if nxt == start:  # back at the start: walk the path home
                    path = [start, node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")  # pragma: no cover


def _describe_cycle(graph: Graph, component: List[str]) -> str:
    """One loop of the component with the imports that make it (where, and whether lazy), then the
    component's modules when it holds more than that loop (each loop in it must be broken)."""
    loop = _loop(graph, component)
    lines = ["import cycle: " + " -> ".join(loop)]
    for source, target in zip(loop, loop[1:]):
        for imp in graph[source][target]:
            what = f" ({', '.join(imp.names)})" if imp.names else ""
            lines.append(f"    {imp.where()}: {source} imports {target}{what}")
    if len(component) > len(loop) - 1:
        lines.append(f"    (one tangle of {len(component)} modules, each reachable from each: "
                     f"{', '.join(component)})")
    return "\n".join(lines)


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
    unknown = [f"{m.path}: {m.key!r} is not in LAYERS (tests/test_architecture.py) nor in the layer "
               "table of docs/architecture.md" for m in MODULES if m.key not in LAYERS]
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


def test_no_import_cycles():
    """No module reaches itself through the imports of the package (lazy ones included, those under
    ``if TYPE_CHECKING:`` left out). The message names one loop per cycle and every import in it."""
    graph = _graph(IMPORTS)
    cycles = [_describe_cycle(graph, component) for component in _strongly_connected(graph)]
    _fail("import cycles (break each by moving what both sides need into the lower module, or by "
          "passing a value or a callable in; an import moved into a function still counts)", cycles)


def _fake(edges: str) -> Dict[str, Dict[str, List[Import]]]:
    """A graph from ``"a>b b>a"``: one made-up import per edge."""
    graph: Dict[str, Dict[str, List[Import]]] = {}
    for n, edge in enumerate(edges.split()):
        source, target = edge.split(">")
        module = Module(source, f"{source}.py", False)
        graph.setdefault(source, {})[target] = [Import(module, n + 1, target, (), n % 2 == 1)]
    return graph


def test_the_cycle_finder_on_made_up_graphs():
    assert _strongly_connected(_fake("a>b b>c c>d")) == []                  # a chain
    assert _strongly_connected(_fake("a>b b>c a>c")) == []                  # a diamond is no cycle
    assert _strongly_connected(_fake("a>b b>a c>a")) == [["a", "b"]]        # two modules
    assert _strongly_connected(_fake("a>b b>c c>a c>d d>e e>d f>a")) == [["a", "b", "c"], ["d", "e"]]
    assert _strongly_connected(_fake("a>b b>c c>b c>a")) == [["a", "b", "c"]]  # two loops, one component
    graph = _fake("x>y y>z z>x q>x")
    assert _loop(graph, ["x", "y", "z"]) == ["x", "y", "z", "x"]
    assert _loop(_fake("a>b b>a"), ["a", "b"]) == ["a", "b", "a"]
    text = _describe_cycle(graph, ["x", "y", "z"])
    assert text.splitlines()[0] == "import cycle: x -> y -> z -> x"
    assert "y.py:2 (inside a function): y imports z" in text and "q" not in text and "tangle" not in text
    tangle = _fake("a>b b>a b>c c>b")
    text = _describe_cycle(tangle, _strongly_connected(tangle)[0])
    assert text.splitlines()[0] == "import cycle: a -> b -> a"
    assert text.splitlines()[-1] == "    (one tangle of 3 modules, each reachable from each: a, b, c)"
    # deep chains do not hit the recursion limit
    chain = " ".join(f"m{i}>m{i + 1}" for i in range(5000)) + " m5000>m0"
    assert len(_strongly_connected(_fake(chain))[0]) == 5001


def test_the_cycle_check_sees_lazy_imports_and_skips_type_checking_ones():
    """The graph of two made-up modules importing each other: a lazy import closes the cycle, an
    import under ``if TYPE_CHECKING:`` does not."""
    low = Module("keepalive.units", "keepalive/units.py", False)
    high = Module("keepalive.errors", "keepalive/errors.py", False)
    up = list(_imports(high, ast.parse("from .units import parse_bytes\n")))
    lazy = list(_imports(low, ast.parse("def f():\n    from .errors import KeepaliveError\n")))
    typed = list(_imports(low, ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from .errors import KeepaliveError\n")))
    assert [i.type_only for i in typed if i.target.startswith("keepalive")] == [True]
    assert _strongly_connected(_graph(up + typed)) == []
    cycle = _strongly_connected(_graph(up + lazy))
    assert cycle == [["keepalive.errors", "keepalive.units"]]
    text = _describe_cycle(_graph(up + lazy), cycle[0])
    assert "keepalive/units.py:2 (inside a function): keepalive.units imports keepalive.errors" in text


# ------------------------------------------------------------------------------------- sizes
#: the most lines a class and a function may span, counted from the ``class`` / ``def`` line (its
#: decorators left out) to its last line, as :mod:`ast` reports them. A class over it holds several
#: jobs, a function over it several steps: each is read only by scrolling, and split into named parts
#: it reads top-down. Data tables (the compat inventories) are module-level assignments, not functions.
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 60
#: ``"path: qualified name"`` -> why it may stay over the limit. EMPTY BY GOAL: a definition that
#: needs an entry here is one to split; an entry says why it cannot be yet, and goes when it can.
SIZE_EXEMPT: Dict[str, str] = {}


@dataclass(frozen=True)
class Definition:
    path: str
    line: int
    kind: str       # "class" or "function"
    name: str       # qualified within the module: Checkpointer.__init__, outer.<locals>.inner
    lines: int

    @property
    def limit(self) -> int:
        return MAX_CLASS_LINES if self.kind == "class" else MAX_FUNCTION_LINES

    def describe(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.name}: {self.lines} lines (at most {self.limit})"


def _definitions(path: str, tree: ast.AST, prefix: str = "") -> Iterator[Definition]:
    """Every class and function of a module, methods and nested functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            yield Definition(path, node.lineno, kind, name, node.end_lineno - node.lineno + 1)
            inner = name + "." if kind == "class" else name + ".<locals>."
            yield from _definitions(path, node, inner)
        else:
            yield from _definitions(path, node, prefix)


DEFINITIONS: List[Definition] = [d for m in MODULES for d in _definitions(m.path, _parse(m))]


def _oversized(kind: str) -> List[str]:
    return [d.describe() for d in DEFINITIONS
            if d.kind == kind and d.lines > d.limit and f"{d.path}: {d.name}" not in SIZE_EXEMPT]


def test_the_size_check_on_a_made_up_module():
    source = ("X = [\n" + "    1,\n" * 100 + "]\n"           # a table: no function, never counted
              "class A:\n    def f(self):\n" + "        pass\n" * 3 +
              "def g():\n    def h():\n        return 1\n    return h\n")
    found = {(d.kind, d.name): d.lines for d in _definitions("m.py", ast.parse(source))}
    assert found == {("class", "A"): 5, ("function", "A.f"): 4, ("function", "g"): 4,
                     ("function", "g.<locals>.h"): 2}
    d = Definition("m.py", 3, "function", "A.f", 61)
    assert d.describe() == "m.py:3: function A.f: 61 lines (at most 60)"


def test_no_class_over_400_lines():
    """A class this long holds several jobs: move each into a collaborator of its own."""
    _fail(f"classes over {MAX_CLASS_LINES} lines (split them into collaborators; SIZE_EXEMPT is empty "
          "by goal)", _oversized("class"))


def test_no_function_over_60_lines():
    """A function this long holds several steps: give each a name of its own. A table belongs in a
    module-level assignment (data), not in a function that builds it."""
    _fail(f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps; SIZE_EXEMPT is empty "
          "by goal)", _oversized("function"))


def test_the_size_exemptions_name_real_definitions():
    """An entry of SIZE_EXEMPT whose definition is gone, or back under the limit, goes."""
    sizes = {f"{d.path}: {d.name}": d for d in DEFINITIONS}
    stale = [f"{key}: {'no such definition' if key not in sizes else 'within the limit now'}"
             for key in SIZE_EXEMPT if key not in sizes or sizes[key].lines <= sizes[key].limit]
    _fail("stale entries of SIZE_EXEMPT", stale)
