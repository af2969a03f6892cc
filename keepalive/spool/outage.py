"""The destination's outages as the uploader lives through them: one warning when one begins, one when
it ends, log lines in between.

:class:`Outage` holds what other threads read (``failing``, ``since``, ``last_error``) under its own
lock, and remembers whether the user was told of the current outage: by the uploader, or by a spooled
store that saw the destination fail first and said so itself (:meth:`Outage.note_told`). The warnings'
texts are :func:`outage_warning` and :func:`recovery_warning`: what failed, where the checkpoints wait
meanwhile, and what the user can do (remount Drive, free space).

:func:`is_permanent` tells an error that retrying does not fix (a full or read-only destination, a
quota, no permission) from one that may go away by itself (a network hiccup, a 503): the uploader
retries both, but a flush does not wait for the first (:mod:`keepalive.spool.flushing`).
"""
from __future__ import annotations

import errno
import threading
import time
from typing import Any, Optional, Tuple

from ..units import format_duration
from .mount import REMOUNT_HINT, describe_error, is_mount_error

__all__ = ["Outage", "outage_warning", "recovery_warning", "is_permanent"]

#: errno values no retry fixes: the destination is full, over its quota, read-only, or not ours to write
PERMANENT_ERRNOS = frozenset(code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EROFS,
                                               errno.EACCES, errno.EPERM) if code is not None)
#: HTTP statuses no retry fixes: unauthorised, forbidden (permission or quota), insufficient storage
_PERMANENT_STATUS = frozenset({401, 403, 507})
#: error codes of object stores (botocore's ``response["Error"]["Code"]``) no retry fixes
_PERMANENT_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem", "InvalidAccessKeyId",
                              "SignatureDoesNotMatch", "QuotaExceeded", "EntityTooLarge",
                              "storageQuotaExceeded", "quotaExceeded", "forbidden"})
_PERMANENT_WORDS = ("quota exceeded", "quotaexceeded", "storage quota", "insufficient storage",
                    "no space left", "read-only file system")


def _status_and_code(exc: BaseException) -> Tuple[Any, Any]:
    """The HTTP status and the service's error code an fsspec backend's error carries, if any
    (gcsfs: ``HttpError.code``; botocore: ``response``; aiohttp: ``status``)."""
    status = getattr(exc, "code", None) or getattr(exc, "status", None)
    code = None
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = status or response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = (response.get("Error") or {}).get("Code")
    return status, code


def is_permanent(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is one that retrying does not fix: ENOSPC,
    EDQUOT, EROFS, EACCES / EPERM, an HTTP 401 / 403 / 507, an object store's access or quota code.
    A transient fault (EIO, ENOTCONN, timeouts, 5xx) is not, nor is a vanished mount (it comes back)."""
    seen = 0
    current: Optional[BaseException] = exc
    while current is not None and seen < 6:
        seen += 1
        if isinstance(current, PermissionError) or getattr(current, "errno", None) in PERMANENT_ERRNOS:
            return True
        status, code = _status_and_code(current)
        if status in _PERMANENT_STATUS or code in _PERMANENT_CODES:
            return True
        text = str(current).lower()
        if any(word in text for word in _PERMANENT_WORDS):
            return True
        current = current.__cause__ or current.__context__
    return False


class Outage:
    """The current outage of one uploader's destination (``failing`` is None while it is healthy)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.failing: Optional[str] = None     # what fails now, None while healthy
        self.since: Optional[float] = None     # when it began (time.time())
        self.last_error: Optional[str] = None  # the last failed attempt's error, outage over or not
        self.permanent = False                 # that error is one no retry fixes (is_permanent)
        self._told = False                     # the user has been told of the current outage

    def note_told(self, exc: BaseException) -> bool:
        """A store saw the destination fail and told the user itself: begin the outage as told, so
        only its end is reported from here. True when it is a new outage."""
        with self._lock:
            if self.failing is not None:
                return False
            self.failing, self.since = describe_error(exc), time.time()
            self.permanent = is_permanent(exc)
            self._told = True
            return True

    def fault(self, exc: BaseException) -> str:
        """Record a failed attempt: ``"ongoing"`` (the outage goes on: a log line), ``"tell"`` (a new
        one the user must hear of), or ``""`` (a new one a store has told the user of already)."""
        what = describe_error(exc)
        permanent = is_permanent(exc)
        with self._lock:
            self.last_error, self.permanent = what, permanent
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
            self.permanent = False
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
