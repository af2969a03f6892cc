"""The IPython extension: ``%load_ext keepalive``.

Magics (each takes ``--help``):

* ``%keepalive status [--dir D] [--text | --widget] [--json] [--interval S] [--once]`` - the session
  panel (a live widget in a notebook, text elsewhere). ``%keepalive`` alone is ``status``.
* ``%keepalive dir [PATH] [--reset]`` - show, or set for this kernel, where checkpoints go when a
  ``DriveCheckpoint`` gets no path (``$KEEPALIVE_DIR``).
* ``%keepalive ls [PATH] [--json] [--verify]`` - the runs under PATH (default: the checkpoint dir),
  which are unfinished, and their checkpoints (as ``keepalive ls``).
* ``%resume_training [PATH|RUN] [--replay] [--show] [--dir D] [--takeover] [--no-verify]`` - continue
  the newest unfinished run (or the one named) by re-executing the notebook cell that trained it.
  With several unfinished runs it says which one it picks and how to name each other one.

Loading registers the magics, hooks the cell events that record which cell creates a
``DriveCheckpoint`` (:mod:`keepalive.notebook`), starts idle tracking
(:class:`keepalive.session.IdleTracker`) and says when an unfinished run waits under the default
checkpoint dir, or anywhere else: runs opened with an explicit path (``DriveCheckpoint("/content/drive/
MyDrive/runs/x")``) are recorded in the index of runs (``RUNS.json`` in the default checkpoint dir,
:func:`keepalive.runs.record_run`), which outlives a VM reset where that dir does (Drive). Runs on a
store that does not answer within :data:`LIST_TIMEOUT` seconds are named as unchecked, never waited
for. Loading twice is harmless; ``%unload_ext keepalive`` undoes all of it.

Nothing here imports torch, TensorFlow or ipywidgets at load time.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from .. import (
    notebook,  # the cell recorder (IPython-free, used by the core too)
    report,
    session,
    settings,
)
from .._version import __version__
from ..lifecycle.events import tell_crash
from ..runs import RUN_INDEX, Run, answered_within, find_runs, indexed_runs, locate
from . import cells, tracebacks

MAGIC_NAMES = ("keepalive", "resume_training")
# setup-cell lines a replay leaves out: they only load keepalive or show something
_DISPLAY_ONLY = re.compile(r"^%(re)?load_ext\s+keepalive\s*$"
                           r"|^%keepalive(\s+(status|ls|-h|--help)(\s.*)?|\s+dir)?\s*$")


# ------------------------------------------------------------------------------------ runs
#: one run under a checkpoint dir: its destination and this machine's spool (:mod:`keepalive.runs`)
RunState = Run


#: seconds the notice of ``%load_ext`` and a bare ``%resume_training`` wait for the runs recorded in
#: the index (a remote store without network must not hang a notebook's first cell)
LIST_TIMEOUT = 10.0


def scan_runs(root: str) -> List[Run]:
    """Every run at or below ``root`` (and runs for it that so far exist only in this machine's
    spool), the one with the newest checkpoint first; [] when there are none."""
    return sorted(find_runs(root), key=lambda r: r.created, reverse=True)


def known_runs(root: str, index_dir: Optional[str] = None, timeout: float = LIST_TIMEOUT
               ) -> "tuple[List[Run], List[Run]]":
    """``(runs, silent)``: the runs under ``root`` and those the index of runs in ``index_dir``
    (default: the default checkpoint dir) records elsewhere, newest checkpoint first; ``silent``:
    recorded runs whose store did not answer within ``timeout`` seconds."""
    try:
        here = find_runs(root)
    except Exception:  # noqa: BLE001 - a root that cannot be read: the recorded runs may still answer
        here = []
    recorded = indexed_runs(index_dir or session.default_checkpoint_dir(), exclude_below=root)
    urls = {r.url for r in here}
    answered, silent = answered_within([r for r in recorded if r.url not in urls], timeout)
    runs = sorted(here + answered, key=lambda r: r.created, reverse=True)
    return runs, silent


def resume_argument(run: Run, runs: Sequence[Run], root: str) -> str:
    """What to write after ``%resume_training`` to name ``run``: its name where it lies under
    ``root`` and no other known run has that name, else its folder (path or URL)."""
    from ..store import is_at_or_below

    same_name = [r for r in runs if r.run == run.run]
    if len(same_name) == 1 and is_at_or_below(run.url, root):
        return run.run
    return shlex.quote(run.url)


def _silent_line(silent: Sequence[Run], index_dir: str) -> str:
    urls = ", ".join(r.url for r in silent[:4]) + (" ..." if len(silent) > 4 else "")
    return (f"keepalive: {len(silent)} run(s) recorded in {index_dir.rstrip('/')}/{RUN_INDEX} did not "
            f"answer within {LIST_TIMEOUT:.0f} s (no network? credentials?), not checked: {urls}")


def _first_line(source: str, width: int = 70) -> str:
    lines = [ln for ln in (source or "").strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    text = lines[0].strip()
    if len(text) > width:
        return text[:width - 3] + "..."
    return text + (" ..." if len(lines) > 1 else "")


def _excerpt(source: str, names: set, limit: int = 10) -> List[str]:
    """A setup cell as shown in a message: whole when short, else its first line and the lines
    that define ``names``."""
    src_lines = source.rstrip().splitlines()
    if len(src_lines) <= limit:
        return [f"      {ln}" for ln in src_lines]
    wanted = [n for n in cells.defining_lines(source, names) if 1 <= n <= len(src_lines)][:limit]
    out, last = [], 0
    for n in [1] + [n for n in wanted if n != 1]:
        if n > last + 1:
            out.append("      ...")
        out.append(f"      {src_lines[n - 1]}")
        last = n
    if last < len(src_lines):
        out.append("      ...")
    return out


def _cell_label(cell: Dict[str, Any]) -> str:
    n = cell.get("execution_count")
    return f"[{n}]" if n is not None else "[?]"


def _lease_note(state: Run) -> str:
    """How far the last writer got past its newest checkpoint (from its lease's heartbeat)."""
    step = (state.writer_progress() or {}).get("step")
    newest = state.newest
    if newest is not None and isinstance(step, int) and newest.step is not None and step > newest.step:
        return f"; it had reached step {step}, so about {step - newest.step} step(s) will be redone"
    return ""


def unfinished_notice(root: Optional[str] = None) -> Optional[str]:
    """The ``%load_ext`` lines about unfinished runs under ``root`` and those the index of runs
    records anywhere else (None when there are none): the newest in full, then every other one
    with where it lives and how to resume it."""
    root = root or session.default_checkpoint_dir()
    index_dir = session.default_checkpoint_dir()
    known, silent = known_runs(root, index_dir)
    runs = [r for r in known if r.unfinished]
    lines: List[str] = []
    if runs:
        r = runs[0]
        writer = r.live_writer()
        if writer is not None:
            lines.append(f"keepalive: run '{r.run}' in {r.url} is being trained right now by another "
                         f"session (host {writer.get('host')}, pid {writer.get('pid')}); its newest "
                         f"checkpoint: {r.where()}.")
        else:
            lines.append(f"keepalive: unfinished run '{r.run}' in {r.url} stopped at {r.where()}"
                         f"{_lease_note(r)}.")
            cell = (r.metadata.get("context") or {}).get("cell") or {}
            if cell.get("source"):
                lines.append(f"           Its training cell {_cell_label(cell)}: {_first_line(cell['source'])}")
                lines.append("           To continue: run your setup cells, then  %resume_training"
                             + ("" if len(runs) == 1 else f" {resume_argument(r, known, root)}")
                             + "   (or  %resume_training --replay  to re-run the recorded setup cells first)")
            else:
                lines.append("           To continue: run the cell that trains it again (it resumes by itself).")
        if len(runs) > 1:
            lines.append(f"           {len(runs) - 1} more unfinished run(s):")
            for x in runs[1:_MAX_NAMED]:
                lines.append(f"             '{x.run}' in {x.url}, stopped at {x.where()}:  "
                             f"%resume_training {resume_argument(x, known, root)}")
            if len(runs) > _MAX_NAMED:
                lines.append(f"             ... and {len(runs) - _MAX_NAMED} more (%keepalive ls)")
    if silent:
        lines.append(_silent_line(silent, index_dir))
    return "\n".join(lines) or None


_MAX_NAMED = 8  # unfinished runs named one per line by the notice


def _run_state(r: Run, listed: Sequence[Any], verified: bool, known: Sequence[Run], root: str) -> str:
    """A run's state in ``%keepalive ls``'s header, from the same listing as the table below it
    (``listed``: the run's checkpoints, newest first, re-read when ``verified``)."""
    if r.error and not listed:
        return f"unreadable: {r.error}"
    # committed with a readable manifest (an error set by verifying them is a failed check)
    committed = [c for c in listed if c.committed and (c.error is None or c.valid is False)]
    if not committed:
        return "no committed checkpoint"
    usable = [c for c in committed if c.valid is not False] if verified else committed
    finished = bool((((committed[0].manifest or {}).get("metadata")) or {}).get("finished"))
    newest = committed[0]
    if not usable:
        return (f"{'finished' if finished else 'UNFINISHED'}, but none of its {len(committed)} checkpoint(s) "
                f"verifies (newest {newest.name}: INVALID, {newest.error})")
    best = usable[0]
    skipped = "" if best is newest else (f" (the newer {newest.name} is INVALID: {newest.error}; "
                                         "a resume falls back past it)")
    if finished and best is newest:
        return f"finished at {r.where(best)}"
    if finished:
        return f"finished, but its last checkpoint is INVALID; newest valid: {r.where(best)}{skipped}"
    return (f"UNFINISHED at {r.where(best)}{skipped}  ->  %resume_training "
            f"{resume_argument(r, known, root)}")


# ---------------------------------------------------------------------------------- parsing
class _Exit(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse for a magic: errors raise UsageError, --help prints and ends the magic."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage().strip()}")

    def exit(self, status: int = 0, message: Optional[str] = None):
        if message:
            print(message, end="")
        raise _Exit()


def _split(line: str) -> List[str]:
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"cannot parse {line!r}: {exc}") from None


def keepalive_parser() -> _Parser:
    p = _Parser(prog="%keepalive", description="keepalive in a notebook: the session panel, where "
                "checkpoints go, and what is stored. `%keepalive` alone shows the status panel.",
                epilog="Also: %resume_training --help.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    s = sub.add_parser("status", help="session time left, idle margin, GPU / RAM / disk / shm, newest checkpoints",
                       description="The session panel: session time left (bar), idle margin, GPU, RAM, "
                                   "disk, /dev/shm and the newest checkpoints. Live (refreshed) as a widget "
                                   "in a notebook, plain text elsewhere.")
    s.add_argument("--dir", default=None, help="checkpoint dir to report on (default: the checkpoint dir)")
    mode = s.add_mutually_exclusive_group()
    mode.add_argument("--text", action="store_const", const="text", dest="mode", help="plain text")
    mode.add_argument("--widget", action="store_const", const="widget", dest="mode", help="force the widget")
    mode.add_argument("--json", action="store_const", const="json", dest="mode", help="the JSON report")
    s.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes of the time bars (5)")
    s.add_argument("--full-every", type=float, default=60.0,
                   help="seconds between refreshes of hardware and checkpoints (60)")
    s.add_argument("--once", action="store_true", help="do not refresh the widget")
    d = sub.add_parser("dir", help="show or set where checkpoints go without a path",
                       description="Without PATH: where a DriveCheckpoint without a path writes, and why. "
                                   "With PATH (local folder or fsspec URL): use it for this kernel "
                                   "(sets $KEEPALIVE_DIR).")
    d.add_argument("path", nargs="?", help="the new checkpoint dir")
    d.add_argument("--reset", action="store_true", help="forget a dir set before (unset $KEEPALIVE_DIR)")
    ls = sub.add_parser("ls", help="runs (finished or not) and their checkpoints under PATH",
                        description="The runs under PATH (default: the checkpoint dir): which are unfinished "
                                    "and how to resume them, then every checkpoint (as `keepalive ls`).")
    ls.add_argument("path", nargs="?", help="a run folder, a folder of runs or a checkpoint folder")
    ls.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    ls.add_argument("--verify", action="store_true", help="re-read every file to check it")
    r = sub.add_parser("report", help="a run across its sessions: picture, redone work, ETA",
                       description="The run's sessions along the step axis, interruptions and redone steps, the "
                                   "loss over all sessions and the ETA (as `keepalive report`), drawn inline.")
    r.add_argument("run", nargs="?", help="the run folder or URL (default: the run trained in this kernel)")
    return p


def resume_parser() -> _Parser:
    p = _Parser(prog="%resume_training",
                description="Continue an unfinished training: pick the newest unfinished run under the "
                            "checkpoint dir or recorded in its index of runs (RUNS.json: runs opened with "
                            "an explicit path elsewhere), or the one named (with several unfinished runs "
                            "it says which it picks and how to name the others), check that the names "
                            "its recorded training cell uses exist in this kernel, then re-execute that "
                            "cell; its DriveCheckpoint resumes from the newest valid checkpoint (falling "
                            "back past damaged ones).",
                epilog="Typical use after a reset: run your setup cells (imports, data, model), then "
                       "%resume_training. Or %resume_training --replay to let keepalive re-run the setup "
                       "cells recorded with the run.")
    p.add_argument("target", nargs="?", metavar="PATH|RUN",
                   help="a run folder / URL, a folder of runs, or the name of a run under the checkpoint dir")
    p.add_argument("--replay", action="store_true",
                   help="re-execute the setup cells recorded with the run (the cells run before the "
                        "training cell in its session) before the training cell")
    p.add_argument("--show", action="store_true",
                   help="only show the recorded training cell and setup cells; run nothing")
    p.add_argument("--dir", default=None, help="where to look for runs (default: the checkpoint dir)")
    p.add_argument("--takeover", action="store_true",
                   help="take the run over even if another live session holds its writer lease")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not re-read the newest checkpoint before re-running the cell")
    return p


# ------------------------------------------------------------------------------------ magics
@magics_class
class KeepaliveMagics(Magics):
    """``%keepalive`` and ``%resume_training``."""

    # ------------------------------------------------------------------------------ %keepalive
    @line_magic("keepalive")  # type: ignore[arg-type]  # IPython's decorator types are loose
    def keepalive(self, line: str = "") -> None:
        """%keepalive [status|dir|ls|report] ...: the session panel, the checkpoint dir, the runs. --help for more."""
        argv = _split(line) or ["status"]
        if argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
            argv = ["status"] + argv
        try:
            args = keepalive_parser().parse_args(argv)
        except _Exit:
            return None
        if args.command == "status":
            return self._status(args)
        if args.command == "dir":
            return self._dir(args)
        if args.command == "ls":
            return self._ls(args)
        if args.command == "report":
            from .report import show_report

            return show_report(args.run)
        keepalive_parser().print_help()
        return None

    def _status(self, args) -> None:
        from . import widget

        if args.mode == "json":
            import json

            from .. import status

            print(json.dumps(status.status_report(checkpoint_dir=args.dir), indent=2, default=str))
            return
        widget.show_status(self.shell, args.dir, mode=args.mode or "auto", interval=args.interval,
                           full_every=args.full_every, live=not args.once)

    def _dir(self, args) -> None:
        if args.reset:
            os.environ.pop("KEEPALIVE_DIR", None)
        if args.path:
            path = os.path.expanduser(args.path)
            os.environ["KEEPALIVE_DIR"] = path
            print(f"keepalive: checkpoints without a path now go to {session.default_checkpoint_dir()}"
                  " (for this kernel; put the same `%keepalive dir` line in your setup cell)")
        else:
            current = session.default_checkpoint_dir()
            if settings.is_set("KEEPALIVE_DIR"):
                why = "$KEEPALIVE_DIR"
            elif current.startswith("/content/drive/"):
                why = "the mounted Google Drive"
            elif current.startswith("/kaggle/working"):
                why = "Kaggle's /kaggle/working, kept when the session ends"
            else:
                why = "the default (no $KEEPALIVE_DIR, no Drive mounted)"
            print(f"keepalive: checkpoints without a path go to {current} ({why}); change with "
                  "%keepalive dir PATH")
        warning = _storage_warning(session.default_checkpoint_dir())
        if warning:
            print(f"keepalive: WARNING {warning}")

    def _ls(self, args) -> None:
        """The runs (unfinished or not, how to resume them), then the table of their checkpoints,
        both from ONE listing (verified once with ``--verify``), so the two always agree: a run the
        header names is in the table, and a checkpoint the table calls INVALID is not where the
        header says the run would resume."""
        import argparse as _ap

        from ..cli import cmd_ls, print_checkpoint_table

        path = args.path or session.default_checkpoint_dir()
        if args.json:
            # cmd_ls without a path: the default dir and the runs its index of runs records elsewhere
            return self._cmd_ls(cmd_ls, _ap.Namespace(path=args.path, json=True, verify=args.verify))
        try:
            runs = scan_runs(path)
        except Exception:  # noqa: BLE001 - the default dir may not exist yet: the index may name runs
            runs = []
        elsewhere: List[Run] = []
        silent: List[Run] = []
        if args.path is None:  # the default dir: also the runs its index records elsewhere
            known, silent = known_runs(path)
            here = {r.url for r in runs}
            elsewhere = [r for r in known if r.url not in here]
        if not runs and not elsewhere:
            # one checkpoint folder, or nothing at all: the table says which
            if silent:
                print(_silent_line(silent, path))
            return self._cmd_ls(cmd_ls, _ap.Namespace(path=args.path, json=False, verify=args.verify))
        listed: Dict[str, list] = {}
        for r in runs + elsewhere:
            try:
                listed[r.url] = r.checkpoints(verify=args.verify, include_uncommitted=True)
            except Exception:  # noqa: BLE001 - its header line says it is unreadable
                listed[r.url] = []
        for title, group in ((f"runs under {path}:", runs),
                             (f"runs elsewhere (recorded in {path.rstrip('/')}/{RUN_INDEX}):", elsewhere)):
            if not group:
                continue
            print(title)
            for r in group:
                state = _run_state(r, listed[r.url], args.verify, runs + elsewhere, path)
                print(f"  {r.run:<20} {state}" + ("" if group is runs else f"\n  {'':<20} in {r.url}"))
            print()
        if silent:
            print(_silent_line(silent, path))
        rows = [info for r in runs + elsewhere for info in reversed(listed[r.url])]
        print_checkpoint_table(rows)
        return None

    @staticmethod
    def _cmd_ls(cmd_ls, namespace) -> None:
        from ..errors import NoCheckpointError

        try:
            cmd_ls(namespace)
        except NoCheckpointError as exc:
            print(f"keepalive: no checkpoints: {exc}")

    # ------------------------------------------------------------------------ %resume_training
    @line_magic("resume_training")  # type: ignore[arg-type]
    def resume_training(self, line: str = "") -> None:
        """%resume_training [PATH|RUN] [--replay] [--show]: continue the newest unfinished run. --help for more."""
        try:
            args = resume_parser().parse_args(_split(line))
        except _Exit:
            return None
        ip = self.shell
        assert ip is not None  # a magic runs in a shell
        root = args.dir or session.default_checkpoint_dir()
        state = self._pick_run(args.target, root, use_index=args.dir is None)
        if state is None:
            return None
        if args.verify:
            info = self._newest_valid(state)
        else:
            info = state.newest
        meta = (info.manifest or {}).get("metadata") or {}
        ctx = meta.get("context") or {}
        cell = ctx.get("cell") or {}
        source = cell.get("source")
        if not source:
            if ctx.get("kind") == "script":
                raise UsageError(
                    f"run '{state.run}' was started by the script {ctx.get('path')} "
                    f"(argv {ctx.get('argv')}), not by a notebook cell: run that script again "
                    "(e.g. !python ...) and it resumes by itself.")
            raise UsageError(f"run '{state.run}' has no recorded notebook cell (it was written by a "
                             "keepalive without the notebook context, or outside IPython): run the cell "
                             "that trains it again; it resumes by itself.")
        setup = list(ctx.get("setup_cells") or [])
        if args.show:
            self._show(state, info, cell, setup)
            return None
        self._check_lease(state, args.takeover)
        print(f"keepalive: run '{state.run}' ({state.url}): newest valid checkpoint at {state.where(info)}")
        with notebook.resuming(ctx):
            if args.replay:
                self._replay(setup, source)
            missing = cells.missing_names(source, ip.user_ns, ip)
            if missing:
                raise UsageError(self._missing_message(state, cell, setup, missing))
            print(f"keepalive: re-running training cell {_cell_label(cell)}: {_first_line(source)}",
                  flush=True)
            before = self._checkpointer_ids()
            result = ip.run_cell(source, store_history=False)
        self._check_target(state, before)
        if result is not None and not result.success:
            err = result.error_in_exec or result.error_before_exec
            what = type(err).__name__ if err is not None else "an error"
            if isinstance(err, KeyboardInterrupt):
                raise UsageError("training interrupted; the newest checkpoint is kept. Run "
                                 "%resume_training again to continue.")
            raise UsageError(f"the training cell stopped with {what} (see above). Its checkpoints are "
                             "kept; fix the cause and run %resume_training again.")
        return None

    # -- helpers
    def _pick_run(self, target: Optional[str], root: str, use_index: bool = True) -> Optional[RunState]:
        """The run to resume: the one ``target`` names (a folder, or a name among the known runs),
        else the newest unfinished one under ``root`` or recorded in the index of runs."""
        from ..errors import NoCheckpointError

        if target and ("/" in target or "://" in target or target.startswith(".") or os.path.exists(target)):
            try:
                where = locate(target)
            except NoCheckpointError as exc:
                raise UsageError(f"nothing to resume at {target}: {exc}") from None
            if where.kind == "checkpoint":
                print(f"keepalive: {target} is one checkpoint; resuming its run, which starts from "
                      "the run's newest valid checkpoint")
            runs = sorted(where.runs, key=lambda r: r.created, reverse=True)
            return self._choose(runs, target, named=where.kind != "root", root=root)
        if use_index:
            runs, silent = known_runs(root)
            if silent:
                print(_silent_line(silent, session.default_checkpoint_dir()))
        else:
            runs = scan_runs(root)
        if target:
            named = [r for r in runs if r.run == target]
            if not named:
                names = ", ".join(sorted({r.run for r in runs})) or "none"
                raise UsageError(f"no run named '{target}' under {root}"
                                 + (" or in its index of runs" if use_index else "")
                                 + f" (runs known: {names}). Give its folder instead: %resume_training PATH")
            return self._choose(named, root, named=True, root=root, known=runs)
        if not runs:
            print(f"keepalive: nothing to resume: no keepalive runs under {root}.\n"
                  "           A DriveCheckpoint without a path writes there (%keepalive dir PATH changes "
                  "it); for a run elsewhere: %resume_training PATH")
            return None
        return self._choose(runs, root, named=False, root=root,
                            also=f" or recorded in its {RUN_INDEX}" if use_index else "")

    def _choose(self, runs: Sequence[RunState], where: str, named: bool, root: Optional[str] = None,
                known: Optional[Sequence[RunState]] = None, also: str = "") -> Optional[RunState]:
        """The newest unfinished run of ``runs``; with several, never silently: a bare
        ``%resume_training`` says which it picks and how to name each other one, a name that fits
        several runs is refused with their folders."""
        if not runs:
            print(f"keepalive: nothing to resume: no keepalive runs under {where}.")
            return None
        unfinished = [r for r in runs if r.unfinished]
        if len(unfinished) > 1:
            known = list(known or runs)
            root = root or where
            if named:
                folders = "\n".join(f"  %resume_training {shlex.quote(r.url)}   ({r.where()})"
                                     for r in unfinished)
                raise UsageError(f"{len(unfinished)} unfinished runs are named '{unfinished[0].run}'; "
                                 f"name one by its folder:\n{folders}")
            r = unfinished[0]
            lines = [f"keepalive: {len(unfinished)} unfinished runs; resuming the newest: '{r.run}' in "
                     f"{r.url} ({r.where()})."]
            for x in unfinished[1:]:
                lines.append(f"           Also waiting: '{x.run}' in {x.url} ({x.where()}); to resume "
                             f"it: %resume_training {resume_argument(x, known, root)}")
            print("\n".join(lines))
            return r
        if unfinished:
            return unfinished[0]
        with_ckpt = [r for r in runs if r.newest is not None]
        if not with_ckpt:
            what = f"run '{runs[0].run}' has" if named else f"no run under {where} has"
            errors = "; ".join(f"{r.run}: {r.error}" for r in runs if r.error)
            print(f"keepalive: nothing to resume: {what} a committed checkpoint yet"
                  + (f" ({errors})" if errors else "")
                  + ". Run the training cell; it starts from the beginning.")
            return None
        r = with_ckpt[0]
        if named:
            print(f"keepalive: nothing to resume: run '{r.run}' has finished ({r.where()}). To train it "
                  "further, raise its number of epochs and run its cell again.")
        else:
            print(f"keepalive: nothing to resume: every run under {where}{also} has finished (newest: "
                  f"'{r.run}', {r.where()}).")
        return None

    def _newest_valid(self, state: RunState):
        """The newest checkpoint that verifies (spooled ones included), saying which are damaged."""
        def damaged(info) -> None:
            report.warn(f"checkpoint {info.name} of run '{state.run}' is damaged ({info.error}); "
                        "falling back to an older one", stream="stdout")

        info = state.newest_valid(on_corrupt=damaged)
        if info is not None:
            return info
        raise UsageError(f"cannot resume run '{state.run}': none of its {state.count} checkpoint(s) "
                         f"verifies. Nothing was run; the files stay as they are "
                         f"(inspect them with: !keepalive verify {state.url}).")

    def _check_lease(self, state: RunState, takeover: bool) -> None:
        # (a lease of this kernel is fine: the core hands it over to the new checkpointer)
        lease_obj = state.destination.lease
        current = state.live_writer()
        if current is None:
            return
        age = time.time() - float(current.get("heartbeat", 0))
        if not takeover:
            raise UsageError(
                f"run '{state.run}' is being written by another live session (host {current.get('host')}, "
                f"pid {current.get('pid')}, heartbeat {age:.0f} s ago). If that session is gone (e.g. the "
                f"old runtime of this notebook), its lease expires in "
                f"{max(0.0, float(current.get('ttl', lease_obj.ttl)) - age):.0f} s; or take the run over "
                "now: %resume_training --takeover")
        lease_obj.acquire(takeover=True)
        lease_obj.release()
        print(f"keepalive: took run '{state.run}' over from host {current.get('host')} "
              f"pid {current.get('pid')}")

    def _replay(self, setup: List[Dict[str, Any]], training_source: str) -> None:
        ip = self.shell
        assert ip is not None  # a magic runs in a shell
        for cell in setup:
            src = cell.get("source") or ""
            skip = self._skip_reason(cell, src, training_source)
            if skip:
                print(f"keepalive: replay: skipping {_cell_label(cell)} ({skip})")
                continue
            print(f"keepalive: replay: running setup cell {_cell_label(cell)}: {_first_line(src)}",
                  flush=True)
            result = ip.run_cell(src, store_history=False)
            if result is not None and not result.success:
                raise UsageError(f"setup cell {_cell_label(cell)} failed on replay (see above); nothing "
                                 "was trained. Fix it, or run the setup cells by hand, then "
                                 "%resume_training again.")

    @staticmethod
    def _skip_reason(cell: Dict[str, Any], src: str, training_source: str) -> Optional[str]:
        if src.strip() == training_source.strip():
            return "the training cell itself"
        if cell.get("ok") is False:
            return "it failed in the original session"
        code = cells.python_source(src)
        for magic in ("resume_training", "unload_ext"):
            if f"run_line_magic('{magic}'" in code or f'run_line_magic("{magic}"' in code:
                return f"%{magic}"
        lines = [ln.strip() for ln in src.strip().splitlines() if ln.strip() and not ln.strip().startswith("#")]
        if lines and all(_DISPLAY_ONLY.match(ln) for ln in lines):
            return "keepalive display only"
        return None

    def _missing_message(self, state: RunState, cell: Dict[str, Any], setup: List[Dict[str, Any]],
                         missing: List[str]) -> str:
        lines = [f"cannot resume run '{state.run}' yet: its training cell {_cell_label(cell)} uses "
                 f"name(s) this kernel does not define: {', '.join(missing)}"]
        defined_by: Dict[str, List[Dict[str, Any]]] = {}
        for c in setup:
            names = cells.defined_names(c.get("source") or "")
            for n in missing:
                if n in names:
                    defined_by.setdefault(n, []).append(c)
        if defined_by:
            lines.append("They were defined by these setup cells of the session that started the run:")
            shown = set()
            for n in missing:
                for c in defined_by.get(n, []):
                    key = id(c)
                    defines = [m for m in missing if any(x is c for x in defined_by.get(m, []))]
                    if key in shown:
                        continue
                    shown.add(key)
                    lines.append(f"  {_cell_label(c)} defines {', '.join(defines)}:")
                    lines.extend(_excerpt(c.get("source") or "", set(defines)))
        unknown = [n for n in missing if n not in defined_by]
        if unknown:
            lines.append(f"No recorded setup cell defines: {', '.join(unknown)}.")
        lines.append("Run those cells (or use %resume_training --replay to re-run the recorded setup "
                     "cells), then %resume_training again. Nothing was trained.")
        return "\n".join(lines)

    def _show(self, state: RunState, info, cell: Dict[str, Any], setup: List[Dict[str, Any]]) -> None:
        print(f"run '{state.run}' ({state.url}), newest valid checkpoint {info.name} "
              f"(step {info.step}, {info.epoch or 0} epoch(s) done)")
        shell = self.shell
        assert shell is not None
        missing = cells.missing_names(cell["source"], shell.user_ns, shell) or []
        print(f"\nsetup cells ({len(setup)} recorded):")
        for c in setup:
            print(f"--- {_cell_label(c)}" + ("  (failed in its session)" if c.get("ok") is False else ""))
            print(c.get("source", "").rstrip())
        print(f"\ntraining cell {_cell_label(cell)}:")
        print(cell["source"].rstrip())
        if missing:
            print(f"\nnot defined in this kernel yet: {', '.join(missing)}")

    @staticmethod
    def _checkpointer_ids() -> set:
        from ..core import active_checkpointers

        return {id(c) for c in active_checkpointers()}

    @staticmethod
    def _check_target(state: RunState, before: set) -> None:
        from ..core import active_checkpointers

        new = [c for c in active_checkpointers() if id(c) not in before]
        if new and not any(c.store.url == state.url for c in new):
            urls = ", ".join(sorted({c.store.url for c in new}))
            report.warn(f"the training cell wrote to {urls}, not to the run you resumed "
                        f"({state.url}): did the path or %keepalive dir / $KEEPALIVE_DIR change?",
                        stream="stdout")


def _storage_warning(root: str) -> Optional[str]:
    """The session module's advice when ``root`` does not outlive the session (Colab VM disk, Kaggle
    outside /kaggle/working)."""
    warn = getattr(session, "_storage_warning", None)
    if warn is None:
        return None
    try:
        return warn(session.detect().platform, root)
    except Exception:  # noqa: BLE001
        return None


# --------------------------------------------------------------------------------- load/unload
_loaded: List[Any] = []


def tell_cell_error(result: Any = None) -> None:
    """``post_run_cell``: an exception that ended a cell's training is told to its listeners as a
    crash (notifications, the heartbeat); a notebook has no uncaught-exception hook for it."""
    error = getattr(result, "error_in_exec", None)
    if error is not None:
        tell_crash(error)


def hook_cell_errors(ip: Any) -> None:
    """Register :func:`tell_cell_error` with ``ip`` (once; nothing without a shell)."""
    callbacks = getattr(getattr(ip, "events", None), "callbacks", None)
    if isinstance(callbacks, dict) and tell_cell_error not in callbacks.get("post_run_cell", []):
        ip.events.register("post_run_cell", tell_cell_error)


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext keepalive``: magics, cell recording, idle tracking, the unfinished-run notice."""
    again = any(s is ip for s in _loaded)
    ip.register_magics(KeepaliveMagics)
    tracebacks.install(ip)
    notebook.register(ip)
    hook_cell_errors(ip)
    try:
        session.tracker().register(ip)
    except Exception as exc:  # noqa: BLE001 - idle tracking is a convenience
        print(f"keepalive: idle tracking is off ({exc})", file=sys.stderr)
    if not again:
        _loaded.append(ip)
    root = session.default_checkpoint_dir()
    print(f"keepalive {__version__}: %keepalive status | dir | ls, %resume_training (--help on each); "
          f"checkpoints without a path go to {root}")
    warning = _storage_warning(root)
    if warning:
        print(f"keepalive: WARNING {warning}")
    try:
        used_up = session.budget_used_up()
    except Exception:  # noqa: BLE001 - loading must never fail over the session's facts
        used_up = None
    if used_up:
        print(f"keepalive: WARNING {used_up}")
    try:
        notice = unfinished_notice(root)
    except Exception as exc:  # noqa: BLE001 - loading must never fail over a listing
        notice = f"keepalive: could not look for unfinished runs under {root}: {exc}"
    if notice:
        print(notice)


def unload_ipython_extension(ip: Any) -> None:
    """``%unload_ext keepalive``: remove the magics and every hook and thread the extension added."""
    from . import widget

    notebook.unregister(ip)
    if tell_cell_error in getattr(getattr(ip, "events", None), "callbacks", {}).get("post_run_cell", []):
        ip.events.unregister("post_run_cell", tell_cell_error)
    tracebacks.uninstall(ip)
    try:
        session.tracker().unregister(ip)
    except Exception:  # noqa: BLE001
        pass
    widget.stop_all()
    mm = getattr(ip, "magics_manager", None)
    if mm is not None:
        for name in MAGIC_NAMES:
            mm.magics.get("line", {}).pop(name, None)
        mm.registry.pop(KeepaliveMagics.__name__, None)
    _loaded[:] = [s for s in _loaded if s is not ip]


# Loaded inside a running IPython (``import keepalive`` in a notebook, before or without
# ``%load_ext``): keepalive's own errors are shown short from now on, and a cell's error that ends a
# training is told to its listeners.
tracebacks.install(session.ipython_shell())
hook_cell_errors(session.ipython_shell())

__all__ = ["load_ipython_extension", "unload_ipython_extension", "KeepaliveMagics", "scan_runs",
           "known_runs", "resume_argument", "RunState", "unfinished_notice", "keepalive_parser",
           "resume_parser", "LIST_TIMEOUT"]
