"""How long a flush waits for a spool's uploads, and what it says when it stops waiting.

A flush (the end of training, ``close()``, SIGTERM, ``atexit``, a stop before the deadline,
``Checkpointer.flush()``) waits until the spool is settled (:meth:`Uploader.settled`). The rules:

* **What matters.** The line "waiting up to ..." counts what will be uploaded
  (:meth:`Uploader.needed`): not the checkpoints that ``keep`` newer ones supersede, which the
  uploader drops instead.
* **Bounded.** At most ``flush_timeout`` seconds (``KEEPALIVE_FLUSH_TIMEOUT``, default 120 s), never
  past the session's end (minus 5 s).
* **Once.** Flushes without a timeout of their own (the end of the loop, then ``close()``, then
  ``atexit``) wait once per newest checkpoint: after one of them stopped waiting with uploads left
  (and said so), the next ones do not wait again for the same checkpoints. A new checkpoint starts a
  new bound. A timeout passed by the caller is the caller's: honoured each time
  (1 s when an earlier flush timed out and nothing moved since).
* **Not for a destination that failed for good.** When the destination's last error is one no retry
  fixes (full, read-only, over quota, no permission: :func:`~keepalive.spool.outage.is_permanent`),
  a flush waits for one more attempt only (at most :data:`PERMANENT_PROBE` seconds: freed space is
  seen at once) and then says in one line, once per outage, where the checkpoints are and how they
  get there later. The uploader goes on retrying while the process lives.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

from .. import report
from ..store import CheckpointInfo
from ..units import format_bytes, format_duration
from .uploader import Uploader

__all__ = ["FlushWait", "PERMANENT_PROBE"]

#: seconds a flush waits for one more attempt at a destination whose last error no retry fixes
PERMANENT_PROBE = 3.0
#: seconds waited before the flush says that it waits (most flushes end before)
FIRST_LOOK = 2.0
_NO_BOUND = object()  # no flush is unfinished: the next one starts a bound of its own


def _size(checkpoints: List[CheckpointInfo]) -> str:
    return format_bytes(sum(c.size_bytes or 0 for c in checkpoints))


class FlushWait:
    """The flushes of one spooled store (module docstring): ``url`` is the destination, ``folder``
    the spool on this machine; ``remaining_fn`` gives the session's seconds left (None: no end)."""

    def __init__(self, url: str, folder: str, flush_timeout: float, *,
                 remaining_fn: Optional[Callable[[], Optional[float]]] = None, quiet: bool = False):
        self.url = url
        self.folder = folder
        self.flush_timeout = flush_timeout
        self.remaining_fn = remaining_fn
        self.quiet = quiet
        self._bound_for: object = _NO_BOUND  # the newest checkpoint the shared bound is for
        self._deadline = 0.0                  # when that bound ends (time.monotonic())
        self._stuck_at: Optional[int] = None  # uploads done when an earlier flush stopped waiting
        self._told: Optional[Tuple[object, object]] = None  # what the last warning was about
        # (newest checkpoint, start of the outage) a flush stopped waiting for
        self._gave_up_on: Optional[Tuple[Optional[str], Optional[float]]] = None

    def wait(self, up: Uploader, timeout: Optional[float]) -> bool:
        """Wait (bounded) until ``up``'s spool is settled; True when it is. When it is not, one warning
        says what is not uploaded, where it is, and what to do (not again while nothing moved)."""
        start = time.monotonic()
        bound = self._bound(up, timeout)
        if up.permanent:
            # one more attempt per outage and newest checkpoint for the flushes in a row; a caller's own
            # timeout gets its own
            again = timeout is not None or self._gave_up_on != (self._newest(up), up.failing_since)
            if not self._works_again(up, min(bound, PERMANENT_PROBE) if again else 0.0):
                return self._stopped(up, timeout)
        bound = max(0.0, bound - (time.monotonic() - start))
        first = min(bound, FIRST_LOOK)
        ok = up.wait_settled(first, until_permanent=True)
        if not ok and bound > first and not up.permanent:
            needed = up.needed()
            if needed:
                report.say(f"waiting up to {format_duration(bound)} for {len(needed)} checkpoint "
                           f"upload(s) ({_size(needed)}) to {self.url}", quiet=self.quiet)
            ok = up.wait_settled(bound - first, until_permanent=True)
        if ok:
            self._stuck_at, self._bound_for = None, _NO_BOUND
            return True
        return self._stopped(up, timeout)

    def _bound(self, up: Uploader, timeout: Optional[float]) -> float:
        bound = self.flush_timeout if timeout is None else float(timeout)
        remaining = self.remaining_fn() if self.remaining_fn is not None else None
        if remaining is not None:
            bound = min(bound, max(0.0, remaining - 5.0))
        if self._stuck_at is not None and self._stuck_at == up.uploaded and up.failing is not None:
            bound = min(bound, 1.0)  # an earlier flush timed out and nothing has moved since
        if timeout is None:
            now, newest = time.monotonic(), self._newest(up)
            if newest != self._bound_for:
                self._bound_for, self._deadline = newest, now + bound
            bound = min(bound, max(0.0, self._deadline - now))
        return bound

    @staticmethod
    def _newest(up: Uploader) -> Optional[str]:
        """The newest checkpoint in the spool, uploaded or not (one uploaded just now, while the flush
        looked, is still the checkpoint this round of flushes is about)."""
        try:
            spooled = up.spool.list()
        except OSError:
            return None
        return spooled[-1].name if spooled else None

    @staticmethod
    def _works_again(up: Uploader, limit: float) -> bool:
        """Whether the destination that failed for good took the next attempt (waited for at most
        ``limit`` seconds, the uploader's backoff cut short)."""
        up.wait_attempt(up.begun, limit)  # a pass begun now: one that began before may predate the fix
        return up.settled() or not up.permanent

    def _stopped(self, up: Uploader, timeout: Optional[float]) -> bool:
        """The flush stops waiting with uploads left: say so, once while nothing moves. Without a
        timeout of the caller's own, the bound of this newest checkpoint is used up: the flushes that
        follow (``close()``, ``atexit``) do not wait again."""
        if timeout is None:
            self._deadline = min(self._deadline, time.monotonic())
        self._stuck_at = up.uploaded
        if up.permanent:
            self._gave_up_on = (self._newest(up), up.failing_since)
        # a destination that fails for good: said once per outage (each flush of a training that
        # saves on would say it again), else once while nothing moved
        told = ("failed for good", up.failing_since) if up.permanent else (self._newest(up), up.uploaded)
        if told != self._told:
            self._told = told
            self._tell(up)
        return False

    def _tell(self, up: Uploader) -> None:
        needed = up.needed()
        if not needed:
            return
        if up.permanent:
            count = f"{len(needed)} checkpoint(s) ({_size(needed)}, newest step {needed[-1].step})"
            report.warn(f"not waiting for the upload of {count} to {self.url}: it fails with an error that "
                        f"retrying does not fix ({up.last_error}). They are safe on this machine's disk in "
                        f"{self.folder}; once the destination has room (or access) again they are uploaded "
                        f"while this process lives, or run: keepalive sync {self.url}", quiet=self.quiet)
            return
        oldest = min((c.created for c in needed if c.created), default=time.time())
        why = f" ({up.last_error})" if up.failing and up.last_error else ""
        age = format_duration(time.time() - oldest)
        report.warn(f"{len(needed)} checkpoint(s) ({_size(needed)}, oldest {age} old, newest step "
                    f"{needed[-1].step}) are not uploaded to {self.url} yet{why}. They are safe on this "
                    f"machine's disk in {self.folder} (not if the VM itself is recycled); uploads go on "
                    f"while this process lives. After a restart, running the training again resumes from "
                    f"them and uploads them, or run: keepalive sync {self.url}", quiet=self.quiet)
