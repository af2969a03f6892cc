"""The destination's outages as the uploader lives through them: one warning when one begins, one when
it ends, log lines in between.

:class:`Outage` holds what other threads read (``failing``, ``since``, ``last_error``) under its own
lock, and remembers whether the user was told of the current outage: by the uploader, or by a spooled
store that saw the destination fail first and said so itself (:meth:`Outage.note_told`). The warnings'
texts are :func:`outage_warning` and :func:`recovery_warning`: what failed, where the checkpoints wait
meanwhile, and what the user can do (remount Drive, free space).
"""
from __future__ import annotations

import errno
import threading
import time
from typing import Optional, Tuple

from ..units import format_duration
from .mount import REMOUNT_HINT, describe_error, is_mount_error

__all__ = ["Outage", "outage_warning", "recovery_warning"]


class Outage:
    """The current outage of one uploader's destination (``failing`` is None while it is healthy)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.failing: Optional[str] = None     # what fails now, None while healthy
        self.since: Optional[float] = None     # when it began (time.time())
        self.last_error: Optional[str] = None  # the last failed attempt's error, outage over or not
        self._told = False                     # the user has been told of the current outage

    def note_told(self, exc: BaseException) -> bool:
        """A store saw the destination fail and told the user itself: begin the outage as told, so
        only its end is reported from here. True when it is a new outage."""
        with self._lock:
            if self.failing is not None:
                return False
            self.failing, self.since = describe_error(exc), time.time()
            self._told = True
            return True

    def fault(self, exc: BaseException) -> str:
        """Record a failed attempt: ``"ongoing"`` (the outage goes on: a log line), ``"tell"`` (a new
        one the user must hear of), or ``""`` (a new one a store has told the user of already)."""
        what = describe_error(exc)
        with self._lock:
            self.last_error = what
            if self.failing is not None:
                return "ongoing"
            self.failing, self.since = what, time.time()
            if self._told:
                return ""
            self._told = True
            return "tell"

    def end(self) -> Optional[Tuple[float, bool]]:
        """The destination works again: ``(seconds the outage lasted, whether the user was told of
        it)``, None when there was none."""
        with self._lock:
            if self.failing is None:
                return None
            took = time.time() - (self.since or time.time())
            self.failing = self.since = None
            told, self._told = self._told, False
        return took, told


def outage_warning(exc: BaseException, *, dest_url: str, spool_folder: str, waiting: int, local: bool,
                   drive: bool, backoff_max: float) -> str:
    """The warning at the start of an outage: ``waiting`` checkpoints wait in ``spool_folder``."""
    where = f"{waiting} checkpoint(s) wait" if waiting else "checkpoints wait"
    if is_mount_error(exc, local):
        reason = getattr(exc, "reason", None) or describe_error(exc)
        return (f"the checkpoint folder {dest_url} is not reachable ({reason}). Training goes "
                f"on; {where} on this machine's disk in {spool_folder} and are uploaded as "
                f"soon as it is back. On Colab remount Drive: {REMOUNT_HINT}")
    hint = ""
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        hint = " The destination is full: free space (on Drive: empty the bin, check the quota)."
    elif code == errno.EIO and drive:
        hint = " On Drive, Errno 5 often means the storage quota is used up."
    return (f"cannot upload checkpoints to {dest_url} ({describe_error(exc)}). Training goes "
            f"on; {where} on this machine's disk in {spool_folder} and are retried with "
            f"backoff (up to {backoff_max:.0f} s apart).{hint}")


def recovery_warning(dest_url: str, took: float, waiting: int) -> str:
    """The warning at the end of an outage the user was told of (a warning too: it ends one, and the
    user who saw that one must see this)."""
    left = f"uploading {waiting} pending checkpoint(s)" if waiting else "nothing left to upload"
    return f"{dest_url} works again (after {format_duration(took)}); {left}"
