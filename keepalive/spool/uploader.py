"""The background uploader: copies a spool's checkpoints to their destination, newest first.

One :class:`Uploader` thread per spool folder and process (:data:`UPLOADERS`; the spooled stores of
a notebook cell run again share it). Each spooled checkpoint is copied data files first and
``MANIFEST.json`` last, and what landed is verified (local and mounted destinations: every byte
re-hashed; object stores: every size read back; the manifest always read back) before the
destination's retention runs and the spooled copy is marked uploaded. The newest uploaded checkpoint
stays in the spool as the local cache; older uploaded ones are deleted. A spooled checkpoint that at
least ``keep`` newer ones supersede (retention would delete it at once) is not uploaded. Failures are
retried with exponential backoff (0.5 s doubling to 30 s, with jitter) for as long as the process
lives; each attempt is bounded by the backend's own timeouts and the store's retry policy.

This module knows nothing of :class:`~keepalive.spool.spooled.SpooledStore`, which imports it. What
an uploader tells a store that uses it goes through one callable, its :data:`UploadListener` (called
on the uploader's thread for every checkpoint that landed); everything else a store learns or asks
goes through the uploader's methods, which take the uploader's own locks.
"""
from __future__ import annotations

import errno
import logging
import os
import random
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

from .. import report, settings
from ..backends import FsspecBackend
from ..errors import LeaseLostError, RunLockedError, StorageError
from ..store import MANIFEST, CheckpointInfo, CheckpointStore, new_hasher
from ..units import format_bytes, format_duration
from .local import Spool
from .mount import REMOUNT_HINT, MountWatch, describe_error, is_mount_error

log = logging.getLogger("keepalive.spool")

BACKOFF_INITIAL = 0.5
BACKOFF_MAX = 30.0
IDLE_POLL = 5.0
COPY_CHUNK = 8 << 20

__all__ = ["Uploader", "UploaderRegistry", "UPLOADERS", "UploadListener"]

#: called on the uploader's thread with each checkpoint that landed and the seconds its upload took
UploadListener = Callable[[CheckpointInfo, float], None]
T = TypeVar("T")


class _SourceGone(Exception):
    """The spooled copy vanished while it was being uploaded (dropped by the size bound)."""


class _NullBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _order(info: CheckpointInfo) -> Tuple[int, float, str]:
    return (info.step if info.step is not None else -1, info.created or 0.0, info.name)


class Uploader:
    """Copies the checkpoints of one :class:`Spool` to their destination store, in a daemon thread.

    Never gives up while the process lives; ``fatal`` is set (and uploads stop) only when the run
    belongs to another session (:class:`RunLockedError` / :class:`LeaseLostError`). Problems are
    reported once per outage (:func:`keepalive.report.warn`), the recovery once too.

    Other threads (the spooled store's writer, a flush) use it through its methods; they read its
    status (``fatal``, ``failing``, ``last_error``, ``uploaded``, ``dropped``, :attr:`seq_floor`) and
    never write its fields. It owns its locks: ``_dest_lock`` while the destination is in use
    (:meth:`exclusive` lends it), ``_spool_lock`` while spooled checkpoints are chosen or dropped,
    ``_state`` for the fields both sides touch.
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
        self._spool_lock = threading.Lock()    # choosing / dropping spooled checkpoints
        # guards what other threads set or read together: the outage fields, the next destination,
        # the open request, the sequence floor, the work counter; waiters for a pass wait on it
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
        self.failing: Optional[str] = None     # the current outage, None while healthy
        self.failing_since: Optional[float] = None
        self.last_error: Optional[str] = None
        self.in_flight: Optional[str] = None
        self.uploaded = 0
        self.dropped = 0
        self.bytes_uploaded = 0
        self.last_ok: Optional[float] = None
        self.dest_known: List[CheckpointInfo] = []   # the destination's checkpoints at the last listing
        self._outage_reported = False

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
        with self._state:
            if self.failing is not None:
                return False
            self.failing, self.failing_since = describe_error(exc), time.time()
            self._outage_reported = True
            return True

    # ------------------------------------------------------------------------------- waiting
    def pending(self) -> List[CheckpointInfo]:
        try:
            return self.spool.pending()
        except OSError:
            return []

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

    def wait_settled(self, timeout: Optional[float]) -> bool:
        """Wait until the spool is :meth:`settled` (True) or ``timeout`` seconds pass / uploads stop
        (False)."""
        self.notify()  # a flush cuts a backoff short: try now
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.settled():
                return True
            if self.fatal is not None or (self.exited and not self.alive):
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            with self._state:
                self._state.wait(0.25 if left is None else min(0.25, left))

    # ---------------------------------------------------------------------------------- loop
    def _run(self) -> None:
        delay = BACKOFF_INITIAL
        try:
            while not self._stop and self.fatal is None:
                self._wake.clear()
                try:
                    with self._dest_lock:
                        touched, worked = self._pass()
                except (RunLockedError, LeaseLostError) as exc:
                    self._set_fatal(exc)
                    break
                except _SourceGone:
                    continue
                except Exception as exc:  # noqa: BLE001 - every storage fault is retried
                    self._fault(exc)
                    self._opened.set()
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

    def _pass(self) -> Tuple[bool, bool]:
        """One round: ``(touched the destination successfully, uploaded or dropped something)``."""
        with self._state:
            if self._next_dest is not None:
                self.dest, self._next_dest = self._next_dest, None
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
        with self._spool_lock:
            with self._state:
                self._work += 1  # from here on this pass changes the spool: not settled until it ends
            pending = self.pending()
            for bad in [c for c in pending if c.error]:
                report.warn(f"spooled checkpoint {bad.name} is damaged ({bad.error}); removing it",
                            quiet=self.quiet)
                self.drop(bad)
            pending = [c for c in pending if not c.error]
            self.dest_known = [c for c in self.dest.list() if c.error is None]
            self._trim_cache(self.dest_known)
            touched = True
            keep = []
            for c in pending:
                if self.superseded(c, pending, self.dest_known):
                    log.info("not uploading %s: %s newer checkpoint(s) supersede it (keep=%s)",
                             c.name, self.dest.keep, self.dest.keep)
                    self.drop(c)
                    self.dropped += 1
                else:
                    keep.append(c)
            if not keep:
                return touched, len(keep) != len(pending)
            chosen = max(keep, key=_order)  # newest first: the one a resume needs
            self.in_flight = chosen.name
        try:
            self._upload(chosen)
        finally:
            self.in_flight = None
        return True, True

    def superseded(self, c: CheckpointInfo, spooled: Sequence[CheckpointInfo],
                   at_dest: Sequence[CheckpointInfo]) -> bool:
        """Whether retention would delete ``c`` at once: ``keep`` newer checkpoints exist (spooled or
        at the destination) and ``keep_every`` does not spare it."""
        keep = self.dest.keep
        if keep is None:
            return False
        every = self.dest.keep_every
        if every and c.seq and c.seq % every == 0:
            return False
        key = _order(c)
        newer = {x.name for x in (*spooled, *at_dest) if _order(x) > key}
        return len(newer) >= keep

    def enforce_bound(self, limit: int) -> Tuple[int, List[CheckpointInfo]]:
        """Make the spool fit in ``limit`` bytes if that can be done safely: uploaded copies (the
        local cache) go first, then un-uploaded checkpoints that ``keep`` newer ones supersede,
        oldest first, never the newest. Returns ``(bytes still held, un-uploaded ones dropped)``."""
        dropped: List[CheckpointInfo] = []
        with self._spool_lock:
            everything = self.spool.list()
            total = sum(c.size_bytes or 0 for c in everything)
            if total <= limit:
                return total, dropped
            for c in everything:  # uploaded copies (the local cache) go first: they are at the destination
                if total > limit and c.cached:
                    self.drop(c)
                    total -= c.size_bytes or 0
            pending = [c for c in everything if not c.cached]
            for c in pending[:-1]:  # oldest first, never the newest
                if total <= limit:
                    break
                if c.name == self.in_flight or not self.superseded(c, pending, self.dest_known):
                    continue
                self.drop(c)
                self.dropped += 1
                dropped.append(c)
                total -= c.size_bytes or 0
        return total, dropped

    def _open_dest(self) -> None:
        lease = self.dest.lease.read()
        # ``ours``: an earlier spooled store of this very process (a notebook cell run again) holds it
        ours = (lease is not None and lease.get("host") == socket.gethostname()
                and lease.get("pid") == os.getpid())
        self.dest.open_for_writing(takeover=self.takeover or ours)
        newest = self.dest.newest_committed()
        if newest is not None and newest.seq:
            self.raise_seq_floor(newest.seq)  # the stores' spools number on from it at their next commit

    def _opened_done(self) -> None:
        """The open request (if any) is answered: the destination's lease is held."""
        with self._state:
            self._want_open = False
            self._opened.set()

    def _trim_cache(self, at_dest: Optional[Sequence[CheckpointInfo]] = None) -> None:
        """Keep the newest uploaded checkpoint as the local cache, drop older uploaded ones (and one
        the destination no longer has: deleted there on purpose)."""
        cached = sorted(self.spool.cached(), key=_order)
        names = None if at_dest is None else {c.name for c in at_dest}
        for i, c in enumerate(cached):
            if i < len(cached) - 1 or (names is not None and c.name not in names):
                self.drop(c)

    def drop(self, c: CheckpointInfo) -> None:
        """Delete a spooled checkpoint (the caller holds ``_spool_lock``)."""
        try:
            self.spool.remove(c)
        except OSError as exc:
            log.info("could not remove spooled %s: %s", c.path, exc)

    # -------------------------------------------------------------------------------- upload
    def _bar(self, c: CheckpointInfo, total: int) -> Any:
        if not self.bars:
            return _NullBar()
        try:
            min_bytes = settings.get("KEEPALIVE_PROGRESS_MIN_BYTES")
            if settings.get("KEEPALIVE_PROGRESS") is False or total < min_bytes:
                return _NullBar()
            from tqdm.auto import tqdm

            url = self.dest.url
            target = url if len(url) <= 48 else "..." + url[-45:]
            return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                        desc=f"keepalive: uploading step {c.step} ({format_bytes(total)}) to {target}",
                        file=sys.stderr, mininterval=0.5)
        except Exception:  # noqa: BLE001 - no tqdm / no display: no bar
            return _NullBar()

    def _upload(self, c: CheckpointInfo) -> None:
        t0 = time.perf_counter()
        b = self.dest.backend
        folder = b.join(self.dest.path, c.name)
        manifest = c.manifest or {}
        algorithm = manifest.get("checksum_algorithm", "xxh3_64")
        try:
            raw = self.spool.backend.read_bytes(os.path.join(c.path, MANIFEST))
        except FileNotFoundError:
            raise _SourceGone(c.name) from None
        bar = self._bar(c, c.size_bytes or 0)
        try:
            b.makedirs(folder)
            for entry in manifest["files"]:
                dst = b.join(folder, entry["name"])
                if not self._landed(dst, entry, algorithm):
                    self._copy(os.path.join(c.path, entry["name"]), dst, bar)
                    if not self._landed(dst, entry, algorithm):
                        raise StorageError(errno.EIO, f"{self.dest.backend.url(dst)} does not match what "
                                                      "was written (size or checksum): retrying")
                else:
                    bar.update(entry["size"])
            self.dest.lease.check()  # LeaseLostError: another session owns the run now
            mpath = b.join(folder, MANIFEST)
            if not self._same_bytes(mpath, raw):
                b.write_bytes(mpath, raw)
                if b.local:
                    b.sync_dir(folder)
                if not self._same_bytes(mpath, raw):
                    raise StorageError(errno.EIO, f"the manifest read back from {b.url(mpath)} differs")
        finally:
            bar.close()
        seconds = time.perf_counter() - t0
        with self._spool_lock:
            try:
                self.spool.mark_uploaded(c)
            except FileNotFoundError:
                pass  # dropped meanwhile by the size bound: it is at the destination anyway
            self._trim_cache()
        self.uploaded += 1
        self.bytes_uploaded += c.size_bytes or 0
        self.last_ok = time.time()
        try:
            self.dest.apply_retention()
            self.dest.lease.renew()
        except OSError as exc:  # the checkpoint is there; old ones go at the next upload
            log.info("retention at %s failed: %s", self.dest.url, exc)
        log.info("uploaded %s (%s) to %s in %.1f s", c.name, format_bytes(c.size_bytes), self.dest.url,
                 seconds)
        for listener in list(self._listeners):
            try:
                listener(c, seconds)
            except Exception as exc:  # noqa: BLE001 - a listener's fault is no upload fault
                log.debug("upload listener failed: %s", exc)

    def _copy(self, src: str, dst: str, bar: Any) -> None:
        b = self.dest.backend
        try:
            f = open(src, "rb", buffering=0)
        except FileNotFoundError:
            raise _SourceGone(src) from None
        with f, b.open_write(dst) as out:
            while True:
                block = f.read(COPY_CHUNK)
                if not block:
                    break
                out.write(block)
                bar.update(len(block))
                if self.progress is not None:
                    self.progress(len(block))
                if self._stop:
                    raise StorageError(errno.ECANCELED, "upload stopped")
            if b.local:
                b.sync(out)

    def _size(self, path: str) -> int:
        b = self.dest.backend
        if b.local:
            return os.path.getsize(path)
        if not isinstance(b, FsspecBackend):  # pragma: no cover - local and fsspec are all there is
            raise TypeError(f"no size lookup for {type(b).__name__}")
        fs = b.fs
        try:
            fs.invalidate_cache(path)
        except Exception:  # noqa: BLE001
            pass
        return int(fs.info(path)["size"])

    def _landed(self, path: str, entry: Mapping[str, Any], algorithm: str) -> bool:
        """Whether ``path`` holds exactly the file ``entry`` describes: the size (every backend) and,
        on local and mounted destinations, the checksum of the bytes read back."""
        try:
            size = self._size(path)
        except FileNotFoundError:
            return False
        if size != entry["size"]:
            return False
        if not self.dest.backend.local:
            return True
        h = new_hasher(algorithm)
        with open(path, "rb", buffering=0) as f:
            while True:
                block = f.read(COPY_CHUNK)
                if not block:
                    break
                h.update(block)
        return h.hexdigest() == entry["checksum"]

    def _same_bytes(self, path: str, raw: bytes) -> bool:
        try:
            if not self.dest.backend.local:
                self._size(path)  # fresh listing first: s3fs / gcsfs cache
            return self.dest.backend.read_bytes(path) == raw
        except FileNotFoundError:
            return False

    # ------------------------------------------------------------------------------ reporting
    def _fault(self, exc: BaseException) -> None:
        if self._stop:
            return
        what = describe_error(exc)
        with self._state:
            self.last_error = what
            ongoing = self.failing is not None
            if not ongoing:
                self.failing, self.failing_since = what, time.time()
            tell = not ongoing and not self._outage_reported  # a store may have told the user already
            if tell:
                self._outage_reported = True
        if ongoing:
            log.info("upload to %s still failing: %s", self.dest.url, what)
        elif tell:
            self._report_outage(exc)

    def _report_outage(self, exc: BaseException) -> None:
        n = len(self.pending())
        where = f"{n} checkpoint(s) wait" if n else "checkpoints wait"
        if is_mount_error(exc, self.dest.backend.local):
            reason = getattr(exc, "reason", None) or describe_error(exc)
            report.warn(f"the checkpoint folder {self.dest.url} is not reachable ({reason}). Training goes "
                        f"on; {where} on this machine's disk in {self.spool.folder} and are uploaded as "
                        f"soon as it is back. On Colab remount Drive: {REMOUNT_HINT}", quiet=self.quiet)
            return
        hint = ""
        code = getattr(exc, "errno", None)
        if code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            hint = " The destination is full: free space (on Drive: empty the bin, check the quota)."
        elif code == errno.EIO and self.mount is not None and self.mount.drive:
            hint = " On Drive, Errno 5 often means the storage quota is used up."
        report.warn(f"cannot upload checkpoints to {self.dest.url} ({describe_error(exc)}). Training goes "
                    f"on; {where} on this machine's disk in {self.spool.folder} and are retried with "
                    f"backoff (up to {BACKOFF_MAX:.0f} s apart).{hint}", quiet=self.quiet)

    def _recovered(self) -> None:
        with self._state:
            if self.failing is None:
                return
            took = time.time() - (self.failing_since or time.time())
            self.failing = self.failing_since = None
            told, self._outage_reported = self._outage_reported, False
        if told:
            n = len(self.pending())
            # a warning too: it ends one, and the user who saw that one must see this
            left = f"uploading {n} pending checkpoint(s)" if n else "nothing left to upload"
            report.warn(f"{self.dest.url} works again (after {format_duration(took)}); {left}",
                        quiet=self.quiet)
            try:
                self.dest.collect_garbage()  # folders of writes the outage cut short
            except OSError as exc:
                log.debug("garbage collection at %s failed: %s", self.dest.url, exc)

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
