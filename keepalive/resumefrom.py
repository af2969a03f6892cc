"""Resume from one place, write to another: ``resume_from=``.

A run with no checkpoint of its own (neither its destination nor this machine's spool of it holds one)
may start from the newest valid checkpoint of another run folder: a checkpoint shared read-only, a
Drive folder copied to a new bucket, a Kaggle version's output mounted read-only at
``/kaggle/input/...``. That folder is only *read*: no lease is taken in it, nothing is written or
deleted there (it is opened as :class:`~keepalive.runs.Run` opens a run for ``keepalive status``,
whose store never writes); the run's new checkpoints go to its own ``path``.

On Kaggle it is automatic: a run under ``/kaggle/working`` with no checkpoint resumes from the same
run in a notebook output mounted under ``/kaggle/input`` (the previous version of a chained notebook,
:mod:`keepalive.kagglechain`), without ``resume_from=``.

>>> told("resuming run 'r' from ckpt-08: at the end of epoch 1, step 8", "ckpt-08", "/mnt/r", "/data/r")
"resuming run 'r' from /mnt/r/ckpt-08: at the end of epoch 1, step 8; saving to /data/r"
"""
from __future__ import annotations

import glob
import os
from typing import Any, Optional, Tuple

from . import report, settings
from .runs import Run
from .session import platforms

__all__ = ["kaggle_input_copy", "newest_elsewhere", "told"]

#: how deep below the input root a notebook's output may be mounted (``/kaggle/input/<slug>/``, or
#: ``/kaggle/input/notebooks/<owner>/<slug>/`` in Kaggle's newer layout)
_INPUT_DEPTH = 3


def _relative_to(url: str, root: str) -> Optional[str]:
    """``url`` relative to the local folder ``root``, None when it lies elsewhere (or is a URL)."""
    if "://" in url and not url.startswith("file://"):
        return None
    path = os.path.abspath(url[len("file://"):] if url.startswith("file://") else url)
    root = os.path.abspath(root)
    if path == root or not path.startswith(root.rstrip("/") + "/"):
        return None
    return os.path.relpath(path, root)


def kaggle_input_copy(url: str) -> Optional[str]:
    """On Kaggle, the copy of the run ``url`` (a folder under the working folder) in a notebook output
    mounted under the input folder, when there is one (the newest, by modification time); else None."""
    if platforms.detect().platform != "kaggle":
        return None
    rel = _relative_to(url, str(settings.get("KEEPALIVE_KAGGLE_WORKING")))
    if rel is None:
        return None
    root = str(settings.get("KEEPALIVE_KAGGLE_INPUT"))
    found = [path for depth in range(1, _INPUT_DEPTH + 1)
             for path in glob.glob(os.path.join(root, *("*",) * depth, rel)) if os.path.isdir(path)]
    return max(found, key=os.path.getmtime) if found else None


def newest_elsewhere(url: str, resume_from: Any, storage_options: Optional[dict],
                     quiet: bool) -> Tuple[Optional[Any], Optional[str]]:
    """``(found, where)``: the newest valid checkpoint (``(info, tree, previous)``, as
    :meth:`keepalive.runs.Run.load_newest`) of ``resume_from``, or of the Kaggle input copy of the run
    ``url`` when ``resume_from`` is not given; ``(None, None)`` when there is none (said, for a
    ``resume_from`` given). Read only: a folder that cannot be read raises its error, as the run's own
    would (starting over instead could bury its checkpoints)."""
    where = os.fspath(resume_from) if resume_from is not None else kaggle_input_copy(url)
    if where is None:
        return None, None
    where = where.rstrip("/")
    if where == url.rstrip("/"):
        return None, None  # the run itself: already looked at
    found = Run(where, storage_options=storage_options).load_newest(quiet=quiet)
    if found is None and resume_from is not None:  # asked for by name: a wrong path must not pass unseen
        report.warn(f"resume_from={where} holds no valid checkpoint: the training starts from scratch into {url}",
                    key=f"resume-from-empty:{where}")
    return (found, where) if found is not None else (None, None)


def told(line: str, name: str, where: str, url: str) -> str:
    """The resume line of a run resumed from elsewhere: the checkpoint named with its folder (which is
    not the run's destination: that part of the line goes), and where the run saves from now on.

    >>> told("resuming run 'r' from ckpt-08: step 8, saved 5 s ago, from the destination /mnt/r", "ckpt-08",
    ...      "/mnt/r", "/data/r")
    "resuming run 'r' from /mnt/r/ckpt-08: step 8, saved 5 s ago; saving to /data/r"
    """
    line = line.replace(f", from the destination {where}", "", 1)
    return f"{line.replace(f' from {name}', f' from {where}/{name}', 1)}; saving to {url}"
