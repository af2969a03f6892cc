"""What a recorded training cell needs: the names it uses that the kernel lacks, and the setup cells
that define them (``%resume_training`` checks these before it re-runs the cell).

Lives with the magics because reading a cell as IPython runs it needs IPython's input transformer;
the recording itself (:mod:`keepalive.notebook`) stays IPython-free for the core.
"""
from __future__ import annotations

import ast
import builtins
from typing import Any, List, Mapping, Optional, Set

from ..notebook import ipython_shell


def python_source(raw: str, ip: Any = None) -> str:
    """The Python code IPython runs for ``raw`` (magics become ``get_ipython()`` calls). A cell magic
    such as ``%%time`` whose body is Python gives the body, so its names can be checked."""
    text = raw
    stripped = raw.lstrip()
    if stripped.startswith("%%"):
        body = stripped.split("\n", 1)[1] if "\n" in stripped else ""
        text = body
    ip = ip if ip is not None else ipython_shell()
    if ip is not None:
        try:
            return ip.transform_cell(text)
        except Exception:  # noqa: BLE001
            return text
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        return TransformerManager().transform_cell(text)
    except Exception:  # noqa: BLE001
        return text


class _Names(ast.NodeVisitor):
    def __init__(self) -> None:
        self.loaded: List[str] = []
        self.defined: Set[str] = set()
        self.star = False

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.loaded.append(node.id)
        else:
            self.defined.add(node.id)

    def _def(self, node) -> None:
        self.defined.add(node.name)
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _def

    def visit_arg(self, node: ast.arg) -> None:
        self.defined.add(node.arg)
        self.generic_visit(node)

    def visit_Import(self, node) -> None:
        for alias in node.names:
            if alias.name == "*":
                self.star = True
            else:
                self.defined.add(alias.asname or alias.name.split(".")[0])

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node) -> None:
        if node.name:
            self.defined.add(node.name)
        self.generic_visit(node)

    def visit_Global(self, node) -> None:
        self.defined.update(node.names)

    visit_Nonlocal = visit_Global

    def generic_visit(self, node) -> None:
        for attr in ("name", "rest"):  # match patterns: MatchAs / MatchStar / MatchMapping
            if type(node).__name__.startswith("Match") and isinstance(getattr(node, attr, None), str):
                self.defined.add(getattr(node, attr))
        super().generic_visit(node)


def _parse(code: str) -> Optional[ast.Module]:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError):
        return None


def defined_names(raw: str, ip: Any = None) -> Set[str]:
    """Names a cell assigns, defines or imports (anywhere in it)."""
    tree = _parse(python_source(raw, ip))
    if tree is None:
        return set()
    v = _Names()
    v.visit(tree)
    return v.defined


def defining_lines(raw: str, names: Set[str], ip: Any = None) -> List[int]:
    """1-based numbers of the lines of ``raw`` whose top-level statements define any of ``names``."""
    tree = _parse(python_source(raw, ip))
    if tree is None:
        return []
    # IPython drops leading blank lines, and python_source a cell magic's first line
    src_lines = raw.splitlines()
    offset = 0
    while offset < len(src_lines) and not src_lines[offset].strip():
        offset += 1
    if raw.lstrip().startswith("%%"):
        offset += 1
        while offset < len(src_lines) and not src_lines[offset].strip():
            offset += 1
    out: List[int] = []
    for stmt in tree.body:
        v = _Names()
        v.visit(stmt)
        if v.defined & names:
            end = getattr(stmt, "end_lineno", None) or stmt.lineno
            out.extend(range(stmt.lineno + offset, end + offset + 1))
    return out


def free_names(raw: str, ip: Any = None) -> Optional[List[str]]:
    """Names a cell reads that it does not define before (top-level statements in order), builtins
    excluded; None when the cell does not parse or star-imports (then nothing can be said)."""
    tree = _parse(python_source(raw, ip))
    if tree is None:
        return None
    seen: Set[str] = set()
    free: List[str] = []
    for stmt in tree.body:
        v = _Names()
        v.visit(stmt)
        if v.star:
            return None
        for name in v.loaded:
            if name not in seen and name not in v.defined and name not in free:
                free.append(name)
        seen |= v.defined
    bi = set(dir(builtins)) | {"get_ipython", "display", "__IPYTHON__", "In", "Out", "exit", "quit"}
    return [n for n in free if n not in bi and not (n.startswith("__") and n.endswith("__"))]


def missing_names(raw: str, namespace: Mapping[str, Any], ip: Any = None) -> Optional[List[str]]:
    """The free names of ``raw`` that ``namespace`` lacks (None: could not tell)."""
    names = free_names(raw, ip)
    if names is None:
        return None
    return [n for n in names if n not in namespace]


__all__ = ["python_source", "defined_names", "free_names", "missing_names", "defining_lines"]
