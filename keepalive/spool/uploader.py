"""The background uploader: copies a spool's checkpoints to their destination, newest first.

One :class:`Uploader` thread per spool folder and process (:data:`UPLOADERS`; the spooled stores of
a notebook cell run again share it). Each spooled checkpoint is copied data files first and
``MANIFEST.json`` last, and what landed is verified (local and mounted destinations: every byte
re-hashed; object stores: every size read back; the manifest always read back) before the
destination's retention runs, the torn folders of failed attempts are removed
(:class:`~keepalive.spool.torn.TornFolders`) and the spooled copy is marked uploaded. The newest uploaded checkpoint
stays in the spool as the local cache; older uploaded ones are deleted. A spooled checkpoint that at
least ``keep`` newer ones supersede (retention would delete it at once) is not uploaded. Failures are
retried with exponential backoff (0.5 s doubling to 30 s, with jitter) for as long as the process
lives; each attempt is bounded by the backend's own timeouts and the store's retry policy.

The uploader is the thread, its loop and its locks; the jobs it runs are its collaborators:
:class:`~keepalive.spool.backlog.Backlog` (which checkpoint goes next, which are dropped or kept as the
local cache), :class:`~keepalive.spool.transfer.CheckpointCopy` (one checkpoint copied and verified)
and :class:`~keepalive.spool.outage.Outage` (an outage told once when it begins, once when it ends).

This module knows nothing of :class:`~keepalive.spool.spooled.SpooledStore`, which imports it. What
an uploader tells a store that uses it goes through one callable, its :data:`UploadListener` (called
on the uploader's thread for every checkpoint that landed); everything else a store learns or asks
goes through the uploader's methods, which take the uploader's own locks.
"""
from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

from .. import report
from ..errors import LeaseLostError, RunLockedError
from ..store import CheckpointInfo, CheckpointStore
from ..units import format_bytes
from .backlog import Backlog
from .local import Spool
from .mount import MountWatch
from .outage import Outage, outage_warning, recovery_warning
from .torn import TornFolders
from .transfer import CheckpointCopy, SourceGone

log = logging.getLogger("keepalive.spool")

BACKOFF_INITIAL = 0.5
BACKOFF_MAX = 30.0
IDLE_POLL = 5.0

__all__ = ["Uploader", "UploaderRegistry", "UPLOADERS", "UploadListener"]

#: called on the uploader's thread with each checkpoint that landed and the seconds its upload took
UploadListener = Callable[[CheckpointInfo, float], None]
T = TypeVar("T")


class Uploader:
    """Copies the checkpoints of one :class:`Spool` to their destination store, in a daemon thread.

    Never gives up while the process lives; ``fatal`` is set (and uploads stop) only when the run
    belongs to another session (:class:`RunLockedError` / :class:`LeaseLostError`). Problems are
    reported once per outage (:func:`keepalive.report.warn`), the recovery once too.

    Other threads (the spooled store's writer, a flush) use it through its methods; they read its
    status (``fatal``, ``failing``, ``permanent``, ``last_error``, ``uploaded``, ``attempts``,
    ``dropped``, :attr:`seq_floor`) and never write its fields. It owns its locks: ``_dest_lock``
    while the destination is in use (:meth:`exclusive` lends it), its backlog's lock while spooled
    checkpoints are chosen or dropped, ``_state`` for the fields both sides touch (the outage's fields
    have their own).
    """

    def __init__(self, spool: Spool, dest: CheckpointStore, *, takeover: bool = False,
                 bars: bool = True, progress: Optional[Callable[[int], None]] = None,
                 mount: Optional[MountWatch] = None, quiet: bool = False):
        self.spool = spool
        self.dest = dest
        self.takeover = takeover
        self.bars = bars
        self.quiet = quiet
        self.progress = progress
        # the watch recorded when the destination was first seen (a later one could anchor above a
        # mount that is already gone)
        self.mount = mount if mount is not None else (MountWatch(dest.path) if dest.backend.local else None)
        self._dest_lock = threading.RLock()    # held while the destination is used (uploads, direct commits)
        self.backlog = Backlog(spool, quiet=quiet)  # its lock: choosing / dropping spooled checkpoints
        self.outage = Outage()
        self.torn = TornFolders(dest)               # torn folders at the destination, removed between uploads
        # guards what other threads set or read together: the next destination, the open request,
        # the sequence floor, the work counter; waiters for a pass wait on it
        self._state = threading.Condition()
        # Work on the spool (dropping, uploading, marking uploaded, evicting older local copies,
        # retention at the destination) happens between two increments of this counter: odd while
        # a piece of work goes on. settled() reads it before and after listing the spool (a seqlock),
        # so a listing taken halfway through (a checkpoint marked uploaded, the copy it supersedes
        # not evicted yet) is never taken for the end.
        self._work = 0
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._next_dest: Optional[CheckpointStore] = None
        self._want_open = False
        self._stop = False
        self._seq_floor = 0
        # the registry's (under its lock): the stores' listeners, and whether no store uses it now
        self._listeners: List[UploadListener] = []
        self._closing = False
        self.exited = False
        self.fatal: Optional[BaseException] = None
        self._opened = threading.Event()       # an attempt to open the destination has finished
        self.uploaded = 0
        self.bytes_uploaded = 0
        self.last_ok: Optional[float] = None
        #: passes over the spool begun, and ended (uploaded, failed or found nothing to do): a flush
        #: waits for one begun after it asked, to learn whether a destination that failed for good
        #: works again (one that began before may have failed just before the space was freed)
        self.begun = 0
        self.attempts = 0

    @property
    def failing(self) -> Optional[str]:
        """The current outage, None while healthy."""
        return self.outage.failing

    @property
    def failing_since(self) -> Optional[float]:
        return self.outage.since

    @property
    def last_error(self) -> Optional[str]:
        return self.outage.last_error

    @property
    def permanent(self) -> bool:
        """The current outage's last error is one no retry fixes (full, read-only, quota, permission):
        uploads go on being retried, but a flush does not wait for them."""
        return self.failing is not None and self.outage.permanent

    @property
    def dropped(self) -> int:
        """Un-uploaded checkpoints dropped because newer ones supersede them."""
        return self.backlog.dropped

    # ------------------------------------------------------------------------------- control
    def start(self) -> "Uploader":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"keepalive-upload-{self.spool.run}",
                                            daemon=True)
            self._thread.start()
        return self

    def notify(self) -> None:
        """Look at the spool now (a checkpoint was committed to it, a flush waits), not at the end of
        the current backoff or idle wait."""
        self._wake.set()

    def open_destination(self, timeout: float = 0.0) -> None:
        """Open the destination (take its writer lease) at the next pass, even with nothing pending,
        and wait up to ``timeout`` seconds for that attempt (not at all during a known outage)."""
        with self._state:
            self._want_open = True
            self._opened.clear()
        self.notify()
        if timeout > 0 and self.failing is None:
            self._opened.wait(timeout)

    def use_destination(self, dest: CheckpointStore, takeover: bool) -> None:
        """Upload to ``dest`` (a newer spooled store's: its lease, its progress) from the next pass."""
        with self._state:
            if dest is not self.dest:
                self._next_dest = dest
                self.takeover = takeover

    @property
    def seq_floor(self) -> int:
        """The newest manifest ``seq`` this uploader knows of (at the destination or spooled): a
        spooled store's commits number on from it."""
        with self._state:
            return self._seq_floor

    def raise_seq_floor(self, seq: int) -> None:
        with self._state:
            self._seq_floor = max(self._seq_floor, seq)

    def exclusive(self, use: Callable[[], T]) -> T:
        """``use()`` while no upload uses the destination (a direct commit there, by a store)."""
        with self._dest_lock:
            return use()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (after the current file) and release the destination's lease."""
        self._stop = True
        self.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def usable(self) -> bool:
        """Its thread runs and goes on running: not retired, the run not lost to another session."""
        return self.alive and not self.exited and self.fatal is None

    def note_outage(self, exc: BaseException) -> bool:
        """A spooled store saw the destination fail and tells the user itself: record the outage as
        reported, so only its end is reported from here. True when it is a new outage."""
        return self.outage.note_told(exc)

    # ------------------------------------------------------------------------------- waiting
    def pending(self) -> List[CheckpointInfo]:
        return self.backlog.pending()

    def needed(self) -> List[CheckpointInfo]:
        """The pending checkpoints that will be uploaded, oldest first: not those that ``keep`` newer
        ones supersede (they are dropped, not uploaded). What a flush waits for."""
        return self.backlog.needed(self.dest)

    def settled(self) -> bool:
        """Whether every spooled checkpoint is uploaded (or dropped as superseded) and nothing the
        uploader does for them is still going on: no upload, no verification, no eviction of an older
        local copy, no retention at the destination."""
        with self._state:
            before = self._work
        if before % 2:
            return False
        empty = not self.pending()
        with self._state:
            return empty and self._work == before

    def caught_up(self) -> bool:
        """The destination works again (an upload succeeded since the last outage) and the spool
        is :meth:`settled`: a store may write to the destination directly again."""
        return self.failing is None and self.last_ok is not None and self.settled()

    def wait_settled(self, timeout: Optional[float], *, until_permanent: bool = False) -> bool:
        """Wait until the spool is :meth:`settled` (True) or ``timeout`` seconds pass / uploads stop
        / (``until_permanent``) the destination fails with an error no retry fixes (False)."""
        self.notify()  # a flush cuts a backoff short: try now
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.settled():
                return True
            if self.fatal is not None or (self.exited and not self.alive) or (until_permanent and self.permanent):
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            with self._state:
                self._state.wait(0.25 if left is None else min(0.25, left))

    def wait_attempt(self, after: int, timeout: float) -> bool:
        """Wait until a pass after the ``after``-th has ended (True), at most ``timeout`` seconds, the
        current backoff cut short. ``after=begun``: a pass that begins after this call."""
        self.notify()
        deadline = time.monotonic() + timeout
        with self._state:
            while self.attempts <= after:
                left = deadline - time.monotonic()
                if left <= 0 or self.fatal is not None or (self.exited and not self.alive):
                    return self.attempts > after
                self._state.wait(min(0.25, left))
        return True

    # ---------------------------------------------------------------------------------- loop
    def _run(self) -> None:
        delay = BACKOFF_INITIAL
        try:
            while not self._stop and self.fatal is None:
                self._wake.clear()
                with self._state:
                    self.begun += 1
                try:
                    with self._dest_lock:
                        touched, worked = self._pass()
                except (RunLockedError, LeaseLostError) as exc:
                    self._set_fatal(exc)
                    break
                except SourceGone:
                    self._attempted()
                    continue
                except Exception as exc:  # noqa: BLE001 - every storage fault is retried
                    self._fault(exc)
                    self._opened.set()
                    self._attempted()
                    self._wake.wait(delay * (0.5 + random.random()))
                    delay = min(delay * 2, BACKOFF_MAX)
                    continue
                finally:
                    with self._state:
                        if self._work % 2:
                            self._work += 1  # the piece of work this pass began is over
                        self._state.notify_all()
                delay = BACKOFF_INITIAL
                if touched:
                    self._recovered()
                self._attempted()
                if worked:
                    continue
                if UPLOADERS.retire_if_idle(self):
                    break
                self._wake.wait(IDLE_POLL)
        finally:
            UPLOADERS.retire(self)
            if self.fatal is None:
                try:
                    self.dest.close()  # the writer lease: released once nothing is left to upload
                except Exception as exc:  # noqa: BLE001
                    log.debug("could not release the lease of %s: %s", self.dest.url, exc)
            self._opened.set()
            with self._state:
                self._state.notify_all()

    def _attempted(self) -> None:
        """A pass ended, and what it taught (an outage begun or over) is recorded."""
        with self._state:
            self.attempts += 1
            self._state.notify_all()

    def _pass(self) -> Tuple[bool, bool]:
        """One round: ``(touched the destination successfully, uploaded or dropped something)``."""
        with self._state:
            if self._next_dest is not None:
                self.dest, self._next_dest = self._next_dest, None
                self.torn = TornFolders(self.dest)
            want_open = self._want_open
        if want_open and self.dest.lease.held:
            self._opened_done()
            want_open = False
        pending = self.pending()
        touched = False
        if not pending and not (want_open and not self.dest.lease.held):
            return False, False
        if self.mount is not None:
            self.mount.check()
        if not self.dest.lease.held:
            self._open_dest()
            touched = True
        self._opened_done()
        if not pending:
            return touched, False
        with self.backlog.lock:
            with self._state:
                self._work += 1  # from here on this pass changes the spool: not settled until it ends
            chosen, dropped = self.backlog.choose(self.dest)
            if chosen is None:
                return True, dropped
        try:
            self._upload(chosen)
        finally:
            self.backlog.in_flight = None
        return True, True

    def enforce_bound(self, limit: int) -> Tuple[int, List[CheckpointInfo]]:
        """Make the spool fit in ``limit`` bytes if that can be done safely
        (:meth:`Backlog.enforce_bound`): ``(bytes still held, un-uploaded ones dropped)``."""
        return self.backlog.enforce_bound(limit, self.dest)

    def _open_dest(self) -> None:
        lease = self.dest.lease.read()
        # ``ours``: an earlier spooled store of this very process (a notebook cell run again) holds it
        ours = (lease is not None and lease.get("host") == socket.gethostname()
                and lease.get("pid") == os.getpid())
        if not ours:
            self.torn.opening()
        self.dest.open_for_writing(takeover=self.takeover or ours)
        newest = self.dest.newest_committed()
        if newest is not None and newest.seq:
            self.raise_seq_floor(newest.seq)  # the stores' spools number on from it at their next commit

    def _opened_done(self) -> None:
        """The open request (if any) is answered: the destination's lease is held."""
        with self._state:
            self._want_open = False
            self._opened.set()

    # -------------------------------------------------------------------------------- upload
    def _upload(self, c: CheckpointInfo) -> None:
        t0 = time.perf_counter()
        self.torn.began(c.name)
        CheckpointCopy(c, self.spool.backend, self.dest, bars=self.bars, progress=self.progress,
                       stopped=lambda: self._stop).run()
        seconds = time.perf_counter() - t0
        self.torn.ours.discard(c.name)  # committed there now: never removed as torn
        self.backlog.uploaded(c)
        self.uploaded += 1
        self.bytes_uploaded += c.size_bytes or 0
        self.last_ok = time.time()
        try:
            self.dest.apply_retention()
            self.dest.lease.renew()
        except OSError as exc:  # the checkpoint is there; old ones go at the next upload
            log.info("retention at %s failed: %s", self.dest.url, exc)
        # earlier attempts cut short (a full destination: one per checkpoint tried)
        self.torn.remove(committed=[c.name, *(k.name for k in self.backlog.dest_known)])
        log.info("uploaded %s (%s) to %s in %.1f s", c.name, format_bytes(c.size_bytes), self.dest.url,
                 seconds)
        for listener in list(self._listeners):
            try:
                listener(c, seconds)
            except Exception as exc:  # noqa: BLE001 - a listener's fault is no upload fault
                log.debug("upload listener failed: %s", exc)

    # ------------------------------------------------------------------------------ reporting
    def _fault(self, exc: BaseException) -> None:
        if self._stop:
            return
        said = self.outage.fault(exc)
        if said == "ongoing":
            log.info("upload to %s still failing: %s", self.dest.url, self.outage.last_error)
        elif said == "tell":
            report.warn(outage_warning(exc, dest_url=self.dest.url, spool_folder=self.spool.folder,
                                       waiting=len(self.pending()), local=self.dest.backend.local,
                                       drive=self.mount is not None and self.mount.drive,
                                       backoff_max=BACKOFF_MAX), quiet=self.quiet)

    def _recovered(self) -> None:
        ended = self.outage.end()
        if ended is None or not ended[1]:
            return
        report.warn(recovery_warning(self.dest.url, ended[0], len(self.pending())), quiet=self.quiet)
        self.exclusive(self.torn.remove)  # folders of writes the outage cut short

    def _set_fatal(self, exc: BaseException) -> None:
        self.fatal = exc
        self._opened.set()
        report.warn(f"stopped uploading to {self.dest.url}: {exc} Spooled checkpoints stay in "
                    f"{self.spool.folder}.", quiet=self.quiet)


class UploaderRegistry:
    """The uploaders of this process, one per spool folder.

    A notebook cell run again builds a new spooled store for the same run while the old one's
    uploads go on: both share one uploader, each with its :data:`UploadListener`. An uploader no
    store uses any more ends once its spool is empty.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._by_folder: Dict[str, Uploader] = {}

    def __len__(self) -> int:
        return len(self._by_folder)

    def values(self) -> List[Uploader]:
        with self.lock:
            return list(self._by_folder.values())

    def attach(self, folder: str, dest: CheckpointStore, takeover: bool, listener: UploadListener,
               make: Callable[[], Uploader]) -> Uploader:
        """The live uploader of the spool ``folder`` (started with ``make()`` when there is none;
        else uploading to ``dest`` from its next pass), with ``listener`` among its listeners."""
        with self.lock:
            up = self._by_folder.get(folder)
            if up is None or up.exited or up.fatal is not None:
                up = make()
                self._by_folder[folder] = up
                up.start()
            else:
                up.use_destination(dest, takeover)
            if listener not in up._listeners:
                up._listeners.append(listener)
            up._closing = False
        return up

    def detach(self, up: Uploader, listener: UploadListener) -> None:
        """The store of ``listener`` is closed; with no store left the uploader ends once the spool
        is empty."""
        with self.lock:
            if listener in up._listeners:
                up._listeners.remove(listener)
            if not up._listeners:
                up._closing = True
        up.notify()

    def retire(self, up: Uploader) -> None:
        """``up`` ends: stores attach to a new uploader from now on."""
        with self.lock:
            self._retire(up)

    def retire_if_idle(self, up: Uploader) -> bool:
        """Retire ``up`` when no store uses it and nothing is pending (True then)."""
        with self.lock:
            if up._closing and not up._listeners and not up.pending():
                self._retire(up)
                return True
        return False

    def _retire(self, up: Uploader) -> None:
        up.exited = True
        if self._by_folder.get(up.spool.folder) is up:
            del self._by_folder[up.spool.folder]

    def stop_all(self, timeout: float = 10.0) -> None:
        """Stop every uploader and forget them (tests; a process that must end now)."""
        for up in self.values():
            up.stop(timeout=timeout)
        with self.lock:
            self._by_folder.clear()


#: the uploaders of this process
UPLOADERS = UploaderRegistry()
