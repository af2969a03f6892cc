"""What produced a run: the notebook cell that trains and the cells executed before it.

:func:`capture_context` is called by :class:`keepalive.core.Checkpointer` when a ``DriveCheckpoint``
is created (and again when a save comes from a training loop running in another cell than the one
that created it). Its dict lands in every checkpoint manifest as ``metadata["context"]``::

    {"kind": "notebook",                     # "ipython" in a terminal IPython
     "shell": "ZMQInteractiveShell",
     "cell": {"source": "...", "execution_count": 7, "cell_id": "..."},
     "setup_cells": [{"execution_count": 1, "source": "...", "ok": true}, ...],
     "setup_cells_left_out": 0,              # older cells dropped to keep the manifest small
     "cell_key": "4711:12",                  # which execution of a cell this was (process:counter)
     "recorded_by": "pre_run_cell",          # or "history" without %load_ext keepalive
     "notebook": "/path/x.ipynb",            # when the front end says (JPY_SESSION_NAME, VS Code)
     "recorded_at": "2025-01-01T12:00:00Z"}

With ``%load_ext keepalive`` the running cell comes from IPython's ``pre_run_cell`` event and each
cell's success from ``post_run_cell``; without it, from IPython's input history (``In``). Setup cells
are the cells stored in that history before the running one (so cells run before ``%load_ext`` are
included). ``%resume_training`` re-executes the recorded cell; while it does, :func:`resuming`
makes :func:`capture_context` return the original record, so a run keeps naming the cell that
started it however often it is resumed.

Cells are written into checkpoint manifests, next to the checkpoints (Drive, a bucket): a setup cell
holding a secret (an API key, a token) travels with them. ``KEEPALIVE_RECORD_CELLS=cell`` records the
training cell only, ``=none`` nothing (``%resume_training`` then cannot re-run the cell; re-running the
training cell by hand still resumes).

Nothing here imports a framework; everything is cheap (no parsing at record time).
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import sys
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from . import report, settings
from . import session as _session
from .runidentity import optuna_run
from .runs import open_run
from .session import ipython_shell as _session_shell

log = logging.getLogger("keepalive")

#: setup cells kept in a record: at most this many characters of source in all, and this many cells
MAX_SETUP_CHARS = 256 * 1024
MAX_SETUP_CELLS = 300

_counter = itertools.count(1)
_TOKEN = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"   # pids repeat across Colab runtimes; this does not
_stack: List[Dict[str, Any]] = []          # cells running now (nested run_cell calls included)
_results: Dict[int, bool] = {}             # execution_count -> success, from post_run_cell
_override: List[Dict[str, Any]] = []       # contexts pinned by %resume_training
_registered: List[Any] = []                # shells whose events we hook


ipython_shell = _session_shell  # the running IPython shell or None (never imports IPython)


# ------------------------------------------------------------------------------------ recording
def pre_run_cell(info: Any = None) -> None:
    """IPython ``pre_run_cell`` event: remember the cell that starts running."""
    raw = getattr(info, "raw_cell", None)
    _stack.append({"key": f"{_TOKEN}:{next(_counter)}", "source": raw if isinstance(raw, str) else "",
                   "store_history": bool(getattr(info, "store_history", False)),
                   "cell_id": getattr(info, "cell_id", None)})


def post_run_cell(result: Any = None) -> None:
    """IPython ``post_run_cell`` event: the cell ended; note whether it succeeded."""
    info = getattr(result, "info", None)
    raw = getattr(info, "raw_cell", None)
    # An empty cell fires post_run_cell without pre_run_cell: pop only the cell that ends.
    if _stack and (raw is None or _stack[-1]["source"] == raw):
        _stack.pop()
    count = getattr(result, "execution_count", None)
    if isinstance(count, int) and getattr(info, "store_history", True):
        try:
            _results[count] = bool(result.success)
        except Exception:  # noqa: BLE001
            pass


def register(ip: Any) -> None:
    """Hook ``pre_run_cell`` / ``post_run_cell`` of ``ip`` (idempotent)."""
    if any(s is ip for s in _registered):
        return
    ip.events.register("pre_run_cell", pre_run_cell)
    ip.events.register("post_run_cell", post_run_cell)
    _registered.append(ip)
    # %load_ext runs inside a cell whose pre_run_cell has already fired: remember it as running.
    hist = _history(ip)
    if len(hist) > 1 and hist[-1].strip():
        _stack.append({"key": f"{_TOKEN}:{next(_counter)}", "source": hist[-1],
                       "store_history": True, "cell_id": None, "late": True})


def unregister(ip: Any = None) -> None:
    for shell in [s for s in _registered if ip is None or s is ip]:
        for name, fn in (("pre_run_cell", pre_run_cell), ("post_run_cell", post_run_cell)):
            try:
                shell.events.unregister(name, fn)
            except ValueError:
                pass
        _registered.remove(shell)
    if not _registered:
        _stack.clear()


def is_registered() -> bool:
    return bool(_registered)


@contextlib.contextmanager
def resuming(context: Mapping[str, Any]) -> Iterator[None]:
    """While ``%resume_training`` re-executes a recorded cell, runs keep their original record."""
    pinned = dict(context)
    pinned["resumed"] = int(pinned.get("resumed", 0)) + 1
    pinned["resumed_at"] = _iso(time.time())
    _override.append(pinned)
    try:
        yield
    finally:
        _override.remove(pinned)


# ------------------------------------------------------------------------------------ capturing
def _history(ip: Any) -> List[str]:
    hm = getattr(ip, "history_manager", None)
    hist = getattr(hm, "input_hist_raw", None)
    if hist is None:
        hist = (getattr(ip, "user_ns", None) or {}).get("_ih")
    return list(hist) if hist is not None else []


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _notebook_path(ip: Any) -> Optional[str]:
    ns = getattr(ip, "user_ns", None) or {}
    path = ns.get("__vsc_ipynb_file__") or os.environ.get("JPY_SESSION_NAME")
    return str(path) if path else None


def current_cell_key() -> Optional[str]:
    """Identifies the cell execution running now (cheap; the core compares it between saves)."""
    if _override:
        return _override[-1].get("cell_key")
    if _stack:
        return _stack[-1]["key"]
    ip = ipython_shell()
    if ip is None:
        return None
    return f"{_TOKEN}:hist:{len(_history(ip)) - 1}"


def current_cell_source() -> Optional[str]:
    """The source of the cell running now (while ``%resume_training`` re-runs a recorded cell: that
    cell's recorded source), or None outside IPython. Adapters hash it to recognise the same training
    cell in a later kernel, where the cells before it may not have been run again."""
    if _override:
        source = (_override[-1].get("cell") or {}).get("source")
        return source if isinstance(source, str) else None
    if _stack:
        return _stack[-1]["source"]
    ip = ipython_shell()
    if ip is None:
        return None
    hist = _history(ip)
    return hist[-1] if len(hist) > 1 else None


def capture_context(ip: Any = None) -> Optional[Dict[str, Any]]:
    """The running cell and the cells executed before it, as a JSON-able dict; None outside IPython
    (or when no cell is known)."""
    mode = settings.get("KEEPALIVE_RECORD_CELLS")
    if mode in ("none", "0", "off", "no", "false"):
        return None
    if _override:
        return dict(_override[-1])
    ip = ip if ip is not None else ipython_shell()
    if ip is None:
        return None
    cell = _running_cell(_history(ip))
    if cell is None:
        return None
    source, key, cell_id, count, before, recorded_by = cell
    if not source or not source.strip():
        return None
    kept, left_out = _setup_cells(before, mode)
    shell = type(ip).__name__
    kernel = any(c.__name__ == "ZMQInteractiveShell" for c in type(ip).__mro__)
    ctx: Dict[str, Any] = {
        "kind": "notebook" if kernel else "ipython",
        "shell": shell,
        "cell": {"source": source, "execution_count": count, "cell_id": cell_id},
        "setup_cells": kept,
        "setup_cells_left_out": left_out,
        "cell_key": key,
        "recorded_by": recorded_by,
        "recorded_at": _iso(time.time()),
        "pid": os.getpid(),
    }
    nb = _notebook_path(ip)
    if nb:
        ctx["notebook"] = nb
    return ctx



def _running_cell(hist: List[str]) -> Optional[Tuple[str, str, Optional[str], Optional[int], List[str], str]]:
    """``(source, key, cell id, execution count, the cells run before it, recorded by)`` of the running
    cell: from the cell hooks' stack, else from the history (None: no cell run yet)."""
    top = _stack[-1] if _stack else None
    count: Optional[int]
    if top is None:
        if len(hist) < 2:
            return None
        count = len(hist) - 1
        return hist[-1], f"{_TOKEN}:hist:{count}", None, count, hist[1:count], "history"
    source = top["source"]
    if top.get("store_history") and len(hist) > 1 and hist[-1].rstrip() == source.rstrip():
        count = len(hist) - 1
        before = hist[1:count]
    else:  # a nested run_cell (not stored in the history): everything stored so far came first
        count = None
        before = hist[1:]
    return source, top["key"], top.get("cell_id"), count, before, "pre_run_cell"


def _setup_cells(before: List[str], mode: Optional[str]) -> Tuple[List[Dict[str, Any]], int]:
    """The cells run before, newest kept first within the bounds, and how many were left out."""
    first = 1
    setup = [{"execution_count": i + first, "source": s, "ok": _results.get(i + first)}
             for i, s in enumerate(before) if s and s.strip()]
    left_out = 0
    total = 0
    kept: List[Dict[str, Any]] = []
    for cell in reversed(setup):
        total += len(str(cell["source"]))
        if total > MAX_SETUP_CHARS or len(kept) >= MAX_SETUP_CELLS:
            left_out = len(setup) - len(kept)
            break
        kept.append(cell)
    kept.reverse()
    if mode == "cell":
        kept, left_out = [], len(setup)
    return kept, left_out

# ----------------------------------------------------------------------------- name analysis
def script_context() -> Optional[Dict[str, Any]]:
    """Outside a notebook: the script that runs (``python train.py``), or None."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if not script:
        return None
    return {"kind": "script", "path": os.path.abspath(script), "argv": list(sys.argv)}



def record_context(metadata: Dict[str, Any], refresh: bool = False) -> None:
    """Record in a run's ``metadata`` what produced it: the notebook cell, or the script. With
    ``refresh`` (a save from a training loop): when the loop runs in another cell than the one that
    created the checkpointer (``ckpt = DriveCheckpoint(...)`` in one cell, the loop in the next), the
    loop's cell becomes the training cell (the creating one a setup cell)."""
    try:
        if refresh:
            key = current_cell_key()
            if key is None or key == (metadata.get("context") or {}).get("cell_key"):
                return
            ctx = capture_context()
        else:
            ctx = capture_context() or script_context()
        if ctx:
            metadata["context"] = ctx
    except Exception as exc:  # noqa: BLE001 - context is informative, never fatal
        if not refresh:
            raise
        log.debug("could not refresh the notebook context: %s", exc)


def default_dir() -> str:
    """``$KEEPALIVE_DIR``, else the mounted Drive, else ``./keepalive-checkpoints``."""
    return _session.default_checkpoint_dir()


#: unnamed checkpointers (no path, no run=) created so far per (cell execution or script, folder)
_UNNAMED: Dict[tuple, int] = {}
#: the run name an older keepalive gave every unnamed checkpointer (still a script's)
LEGACY_RUN = "default"


def normalized_source(source: str) -> str:
    """A cell's code without what an edit that changes nothing leaves behind: trailing spaces, blank
    lines around it, Windows line ends."""
    lines = [line.rstrip() for line in source.replace("\r\n", "\n").split("\n")]
    return "\n".join(lines).strip("\n")


def cell_run_name(source: str) -> str:
    """The run name of an unnamed checkpointer created by the cell ``source``: ``cell-`` and a hash
    of its code, the same in every kernel (a restart, ``%resume_training``) and for every execution of
    that cell, different for another training cell.

    >>> cell_run_name("fit(model)  ") == cell_run_name("fit(model)"), cell_run_name("fit(model)")[:5]
    (True, 'cell-')
    >>> cell_run_name("a = 1") != cell_run_name("a = 2")
    True
    """
    return "cell-" + hashlib.sha256(normalized_source(source).encode()).hexdigest()[:8]


def _legacy_run_of_this_cell(base: str, source: str, name: str) -> bool:
    """Whether an unfinished run ``default`` made by an older keepalive from this very cell is the one
    to continue: the cell's own run ``name`` does not exist yet and ``default``'s newest checkpoint
    records this cell's code. Never raises (a slow or failing store: no)."""
    try:
        if open_run(f"{base}/{name}").newest is not None:
            return False
        legacy = open_run(f"{base}/{LEGACY_RUN}")
        if legacy.newest is None or legacy.finished:
            return False
        recorded = ((legacy.metadata.get("context") or {}).get("cell") or {}).get("source")
        return isinstance(recorded, str) and normalized_source(recorded) == normalized_source(source)
    except Exception as exc:  # noqa: BLE001 - a convenience for runs of older versions
        log.debug("could not look at the run %s/%s: %s", base, LEGACY_RUN, exc)
        return False


def resolve_run_url(path: Union[str, "os.PathLike[str]", None], run: Optional[str] = None,
                    say: Optional[Callable[[str], None]] = None) -> str:
    """The run folder: ``path`` itself, or ``<default dir>/<run>`` without a path.

    Without a path and a name, a notebook cell's checkpointer writes the run named after the cell's
    code (:func:`cell_run_name`): two trainings in two cells never share a run, and the same cell run
    again (after a restart too) finds its own; ``say`` is told in one line which run that is. A
    script's writes ``default``. The n-th checkpointer created by one cell execution (or one script)
    gets ``-<n>`` from the second on: a K-fold loop gets one run per fold, and running the same cell
    again after a reset finds each fold's own run in the same order.
    """
    if path is not None:
        return os.fspath(path)
    base = default_dir().rstrip("/")
    if run is not None:
        return f"{base}/{run}"
    trial = optuna_run(base)  # each trial of an Optuna study its own run (a retried one its original's)
    if trial is not None:
        if say is not None:
            say(trial.line)
        return f"{base}/{trial.name}"
    source = current_cell_source()
    key = (current_cell_key() or "script", base)
    n = _UNNAMED[key] = _UNNAMED.get(key, 0) + 1
    if source is None or not source.strip():
        stem, why = LEGACY_RUN, ""
    else:
        stem, why = cell_run_name(source), "named after this cell's code: running this cell again resumes it"
        if n == 1 and _legacy_run_of_this_cell(base, source, stem):
            stem, why = LEGACY_RUN, "the unfinished run an older keepalive made from this cell"
    run = stem if n == 1 else f"{stem}-{n}"
    if n == 2:
        report.warn(f"a second DriveCheckpoint() without a path or run= in this cell: it writes run '{run}' "
                    f"(then {stem}-3, ...), one per training, in creation order. Name each one, e.g. "
                    "run=f'fold{k}', to make that explicit.")
    if why and say is not None:
        say(f"DriveCheckpoint() without a path or run= writes run '{run}' in {base} ({why}; "
            "run='name' names it)")
    return f"{base}/{run}"

__all__ = ["capture_context", "cell_run_name", "normalized_source", "default_dir", "record_context", "resolve_run_url",
           "current_cell_key", "current_cell_source", "script_context", "pre_run_cell",
           "post_run_cell", "register", "unregister", "is_registered", "resuming", "ipython_shell", "MAX_SETUP_CHARS",
           "MAX_SETUP_CELLS"]
