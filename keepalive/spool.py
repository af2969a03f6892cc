"""Storage faults never stop training: a local spool, a background uploader, a bounded flush.

Google Drive's mount on Colab writes to the VM's disk first and syncs minutes later, loses its FUSE
daemon in long sessions (``Errno 107 Transport endpoint is not connected``), answers ``Errno 5`` when
the quota is full; object stores answer 503 and time out. None of that may stop training or lose a
checkpoint. So a checkpoint can be committed first to a **spool** on the VM's local disk and copied
to its destination by a background **uploader**:

* :class:`Spool` -- a :class:`~keepalive.store.CheckpointStore` on local disk, one per destination run:
  ``$KEEPALIVE_SPOOL/<run>-<hash of the destination URL>/<run>/ckpt-...`` (default root
  ``/tmp/keepalive-spool``) plus ``SPOOL.json`` naming the destination. A spooled commit is the very
  same manifest-last, checksummed, fsync'ed commit as any other, so a spooled checkpoint is durable on
  this machine the moment the writer returns.
* :class:`Uploader` -- one thread per spool and process. It copies spooled checkpoints to the
  destination folder of the same name, **newest first**, data files first and ``MANIFEST.json`` last,
  verifies what landed (local and mounted destinations: every byte re-hashed; object stores: every
  size read back; the manifest always read back), applies the destination's retention and only then
  marks the spooled copy uploaded. The newest uploaded checkpoint stays in the spool as a local copy
  (a resume on this machine reads it from local disk, and works while the destination is down; it is
  ignored when the destination answers without it, e.g. after the run was deleted there); older
  uploaded ones are deleted. A spooled checkpoint that at least ``keep`` newer checkpoints supersede
  (retention would delete it at once) is not uploaded. Failures are retried with exponential backoff
  (0.5 s doubling to 30 s, with jitter) for as long as the process lives; each attempt is bounded by
  the backend's own timeouts (s3fs / gcsfs / aiohttp) and the store's retry policy.
* :class:`SpooledStore` -- what :class:`keepalive.core.Checkpointer`'s writer commits through. With
  ``spool="auto"`` (default) fsspec URLs (``gs://``, ``s3://``, ...) and paths on the Drive mount
  (``/content/drive/...``) always go through the spool; other local paths are written directly and
  switch to the spool when a direct write fails with a storage error (until the destination works
  again and the spool is empty) or takes longer than ``$KEEPALIVE_SPOOL_SLOW`` (10 s; then for the
  rest of the session). ``spool=True`` / ``False`` (or ``KEEPALIVE_SPOOL_MODE=always|never``) force it.

Bounds:

* Training waits only for the *local* spool commit (the writer waits for the previous write, as
  before); nothing on the training thread talks to the remote side, except opening the run at the
  first save, which waits at most ``OPEN_TIMEOUT`` (5 s) for the uploader to take the destination's
  writer lease (so a run locked by another session is still reported at once), and resuming, which
  lists the destination (bounded by the store's retry policy).
* The spool holds at most ``$KEEPALIVE_SPOOL_MAX`` bytes (default: half the free space of its disk
  when it is first needed). When the bound is hit the uploaded local copy goes first; un-uploaded
  checkpoints are dropped (oldest first, with a warning) only if ``keep`` newer checkpoints supersede
  them, never the newest; if that is not enough, a warning says so and nothing else is dropped.
* Flush (normal end, SIGTERM, atexit, deadline stop, ``Checkpointer.flush()``) waits for the uploads
  at most ``flush_timeout`` seconds (default 120 s, ``$KEEPALIVE_FLUSH_TIMEOUT``) and never past the
  session's end; a flush that timed out is not repeated in full while nothing moves. What is still
  pending is printed with what to do (``keepalive sync``).

A vanished mount (the destination's folder disappears, a different filesystem sits there now, or
``ENOTCONN``) is reported once, with the remount command, and uploads resume by themselves when it is
back (reported once too). On Colab with a Drive destination every flush also calls ``os.sync()``; at
the end of a run ``google.colab.drive.flush_and_unmount()`` is called when asked (``drive_flush=True``
/ ``KEEPALIVE_DRIVE_FLUSH=1``), else the advice to call it is printed once.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ._version import __version__
from .errors import LeaseLostError, RunLockedError, StorageError
from .store import (MANIFEST, CheckpointInfo, CheckpointStore, RetryPolicy, WriteResult, _manifest_digest,
                    new_hasher)
from .units import format_bytes, format_duration

log = logging.getLogger("keepalive.spool")

ENV_ROOT = "KEEPALIVE_SPOOL"
ENV_MODE = "KEEPALIVE_SPOOL_MODE"
ENV_MAX = "KEEPALIVE_SPOOL_MAX"
ENV_FLUSH = "KEEPALIVE_FLUSH_TIMEOUT"
ENV_DRIVE_FLUSH = "KEEPALIVE_DRIVE_FLUSH"
ENV_SLOW = "KEEPALIVE_SPOOL_SLOW"
DEFAULT_ROOT = "/tmp/keepalive-spool"
DEFAULT_FLUSH_TIMEOUT = 120.0
DEFAULT_SLOW_SECONDS = 10.0
OPEN_TIMEOUT = 5.0
BACKOFF_INITIAL = 0.5
BACKOFF_MAX = 30.0
IDLE_POLL = 5.0
COPY_CHUNK = 8 << 20
SPOOL_RECORD = "SPOOL.json"
UPLOADED = "UPLOADED.json"  # in a spooled checkpoint's folder: it verified at the destination
DRIVE_ROOT = "/content/drive"
REMOUNT_HINT = "from google.colab import drive; drive.mount('/content/drive', force_remount=True)"
_IN_PROCESS = {"memory"}  # fsspec protocols that are neither remote nor slow: written directly
_CONFIG_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EROFS, errno.EISDIR}
_SECRET = re.compile(r"secret|token|password|passwd|credential|key|auth", re.I)


# ------------------------------------------------------------------------------------ settings
def spool_root(root: Optional[str] = None) -> str:
    """The spool's root folder: ``root``, else ``$KEEPALIVE_SPOOL``, else ``/tmp/keepalive-spool``."""
    return os.path.abspath(os.path.expanduser(root or os.environ.get(ENV_ROOT) or DEFAULT_ROOT))


def resolve_mode(spool: Union[str, bool, None] = "auto") -> str:
    """``"auto"``, ``"always"`` or ``"never"`` from ``spool=`` (``"auto"`` defers to the env var)."""
    if spool is None or spool == "auto":
        spool = os.environ.get(ENV_MODE, "auto")
    if spool is True:
        return "always"
    if spool is False:
        return "never"
    text = str(spool).strip().lower()
    if text in ("always", "on", "1", "true", "yes"):
        return "always"
    if text in ("never", "off", "0", "false", "no"):
        return "never"
    if text == "auto":
        return "auto"
    raise ValueError(f"spool= takes 'auto', True or False, not {spool!r}")


def parse_bytes(value: Union[str, int, float]) -> int:
    """``"10GB"``, ``"5GiB"``, ``"500M"`` or a number of bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*", str(value), re.I)
    if not m:
        raise ValueError(f"not a size: {value!r} (use e.g. '10GB', '5GiB')")
    number, unit, binary = m.groups()
    power = " kmgt".index(unit.lower() or " ")
    return int(float(number) * (1024 if binary else 1000) ** power)


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        log.warning("ignoring %s=%r: not a number", name, os.environ.get(name))
        return default


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def is_drive_path(path: str) -> bool:
    """Whether a local path lies on the Colab Drive mount."""
    return os.path.abspath(path).startswith(DRIVE_ROOT.rstrip("/") + "/")


def _ismount(path: str) -> bool:
    return os.path.ismount(path)


def _on_colab() -> bool:
    return "google.colab" in sys.modules or bool(os.environ.get("COLAB_RELEASE_TAG"))


def spool_dir_for(dest_url: str, run: str, root: Optional[str] = None) -> str:
    """``<root>/<run>-<12 hex of sha1(destination URL)>``: one spool per destination run."""
    digest = hashlib.sha1(dest_url.encode()).hexdigest()[:12]
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", run)[:40] or "run"
    return os.path.join(spool_root(root), f"{safe}-{digest}")


def _public_options(options: Any) -> Any:
    """Storage options without anything that looks like a secret (SPOOL.json is a plain file)."""
    if isinstance(options, Mapping):
        return {k: _public_options(v) for k, v in options.items() if not _SECRET.search(str(k))}
    if isinstance(options, (list, tuple)):
        return [_public_options(v) for v in options]
    return options if isinstance(options, (str, int, float, bool, type(None))) else str(options)


def _say(message: str, level: int = logging.INFO) -> None:
    log.log(level, message)
    print(f"keepalive: {message}", flush=True)


def _describe(exc: BaseException) -> str:
    name = errno.errorcode.get(getattr(exc, "errno", None) or -1)
    text = str(exc) or type(exc).__name__
    return f"{name}: {text}" if name and name not in text else f"{type(exc).__name__}: {text}"


def _order(info: CheckpointInfo) -> Tuple[int, float, str]:
    return (info.step if info.step is not None else -1, info.created or 0.0, info.name)


# ----------------------------------------------------------------------------------------- spool
class Spool(CheckpointStore):
    """The local spool of one destination run (a checkpoint store on the VM's disk).

    ``seq_floor``: the newest ``seq`` known at the destination, so spooled manifests continue the
    destination's numbering (``keep_every`` counts on it) even when the spool starts empty.
    """

    def __init__(self, folder: str, destination: str, run: str):
        self.folder = folder
        self.destination = destination
        super().__init__(os.path.join(folder, run), keep=None)
        self.seq_floor = 0

    @classmethod
    def for_destination(cls, dest: CheckpointStore, root: Optional[str] = None) -> "Spool":
        return cls(spool_dir_for(dest.url, dest.run, root), dest.url, dest.run)

    def write_record(self, dest: CheckpointStore, storage_options: Optional[dict]) -> None:
        """``SPOOL.json``: which destination these checkpoints are for (for ``keepalive sync``)."""
        os.makedirs(self.path, exist_ok=True)
        record = {"destination": dest.url, "run": dest.run, "keep": dest.keep,
                  "keep_every": dest.keep_every, "storage_options": _public_options(storage_options or {}),
                  "host": socket.gethostname(), "pid": os.getpid(), "updated": time.time(),
                  "keepalive": __version__}
        tmp = os.path.join(self.folder, f".{SPOOL_RECORD}.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, os.path.join(self.folder, SPOOL_RECORD))  # the spool is local disk: rename is fine

    def _manifest(self, name, entries, **kw) -> Dict[str, Any]:
        manifest = super()._manifest(name, entries, **kw)
        if manifest["seq"] <= self.seq_floor:
            manifest["seq"] = self.seq_floor + 1
            manifest.pop("manifest_checksum", None)
            manifest["manifest_checksum"] = _manifest_digest(manifest)
        self.seq_floor = manifest["seq"]
        if getattr(self, "_seq", None) is not None:
            self._seq = manifest["seq"]  # the store's own counter continues from here
        return manifest

    def list(self, include_uncommitted: bool = False) -> List[CheckpointInfo]:
        """As :meth:`CheckpointStore.list`; an uploaded copy kept as the local cache is flagged
        ``info.cache = True`` (a resume uses it only where the destination has it too, or cannot be
        read: a run deleted at the destination on purpose does not come back from here)."""
        out = super().list(include_uncommitted)
        for info in out:
            info.cache = os.path.exists(os.path.join(info.path, UPLOADED))  # type: ignore[attr-defined]
        return out

    def pending(self) -> List[CheckpointInfo]:
        """Committed spooled checkpoints not yet uploaded, oldest first."""
        return [c for c in self.list() if not getattr(c, "cache", False)]

    def cached(self) -> List[CheckpointInfo]:
        """Uploaded checkpoints kept as the local cache (normally the newest one only)."""
        return [c for c in self.list() if getattr(c, "cache", False)]

    def mark_uploaded(self, info: CheckpointInfo) -> None:
        with open(os.path.join(info.path, UPLOADED), "w") as f:
            f.write(json.dumps({"uploaded": time.time(), "to": self.destination}))
        info.cache = True  # type: ignore[attr-defined]

    def has_pending(self) -> bool:
        return os.path.isdir(self.path) and bool(self.pending())


def read_record(folder: str) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(folder, SPOOL_RECORD)) as f:
            record = json.load(f)
        return record if isinstance(record, dict) and "destination" in record else None
    except (OSError, ValueError):
        return None


def list_spools(root: Optional[str] = None) -> List[Tuple[str, Dict[str, Any]]]:
    """``(folder, SPOOL.json record)`` of every spool under the root."""
    base = spool_root(root)
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for name in names:
        folder = os.path.join(base, name)
        record = read_record(folder)
        if record is not None:
            out.append((folder, record))
    return out


def _spool_of(folder: str, record: Mapping[str, Any]) -> Spool:
    return Spool(folder, record["destination"], record.get("run") or "run")


def pending_summary(root: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """What waits in the spool: ``{count, bytes, oldest_age_seconds, destinations: [...]}``, or
    ``None`` when nothing does (``keepalive status``'s ``pending_uploads``)."""
    now = time.time()
    rows = []
    for folder, record in list_spools(root):
        try:
            pending = _spool_of(folder, record).pending()
        except OSError:
            continue
        if not pending:
            continue
        oldest = min((c.created for c in pending if c.created), default=None)
        rows.append({"destination": record["destination"], "spool": folder, "count": len(pending),
                     "bytes": sum(c.size_bytes or 0 for c in pending),
                     "oldest_age_seconds": None if oldest is None else max(0.0, now - oldest),
                     "newest_step": pending[-1].step})
    if not rows:
        return None
    ages = [r["oldest_age_seconds"] for r in rows if r["oldest_age_seconds"] is not None]
    return {"count": sum(r["count"] for r in rows), "bytes": sum(r["bytes"] for r in rows),
            "oldest_age_seconds": max(ages) if ages else None, "destinations": rows}


def format_pending(pending: Optional[Mapping[str, Any]]) -> str:
    if not pending:
        return "none pending"
    if "count" not in pending:
        return f"unknown ({pending.get('error')})"
    text = (f"{pending['count']} checkpoint(s), {format_bytes(pending['bytes'])} pending, oldest "
            f"{format_duration(pending.get('oldest_age_seconds'))} old")
    dests = ", ".join(r["destination"] for r in pending.get("destinations") or [])
    return f"{text} (to {dests}; `keepalive sync` uploads them)" if dests else text


# ------------------------------------------------------------------------------- mount watching
class MountVanished(StorageError):
    """The destination's folder or mount is gone (unmounted, FUSE daemon dead, folder deleted)."""

    def __init__(self, path: str, reason: str, code: int = errno.ENOTCONN):
        super().__init__(code, f"{path} is not reachable: {reason}")
        self.path = path
        self.reason = reason


class MountWatch:
    """Checks that a local destination is still where it was: its nearest existing ancestor at the
    start (the run folder's parent when it exists) still exists, on the same device; for a path on
    the Drive mount, that ``/content/drive`` is still a mount point. Without this, a write into a
    vanished mount would silently create the folders again on the VM's own disk."""

    def __init__(self, path: str):
        self.path = path
        self.drive = is_drive_path(path)
        anchor = os.path.dirname(os.path.abspath(path).rstrip("/")) or "/"
        while True:
            try:
                os.stat(anchor)
                break
            except OSError:
                parent = os.path.dirname(anchor)
                if parent == anchor:
                    break
                anchor = parent
        self.anchor = anchor
        try:
            self.dev: Optional[int] = os.stat(anchor).st_dev
        except OSError:
            self.dev = None

    def check(self) -> None:
        if self.drive and not _ismount(DRIVE_ROOT):
            raise MountVanished(self.path, f"Google Drive is not mounted at {DRIVE_ROOT}")
        try:
            st = os.stat(self.anchor)
        except FileNotFoundError:
            raise MountVanished(self.path, f"the folder {self.anchor} has disappeared") from None
        except OSError as exc:
            raise MountVanished(self.path, f"{self.anchor}: {exc.strerror or exc}",
                                exc.errno or errno.ENOTCONN) from exc
        if self.dev is None:
            self.dev = st.st_dev
        elif st.st_dev != self.dev:
            raise MountVanished(self.path, f"{self.anchor} is on another filesystem now (its mount was lost)")


def _is_mount_error(exc: BaseException, local: bool = True) -> bool:
    """A vanished mount: the watch said so, or ENOTCONN from a local (FUSE-mounted) path."""
    return isinstance(exc, MountVanished) or (local and getattr(exc, "errno", None) == errno.ENOTCONN)


# -------------------------------------------------------------------------------------- uploader
class _SourceGone(Exception):
    """The spooled copy vanished while it was being uploaded (dropped by the size bound)."""


class _NullBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


_REGISTRY: Dict[str, "Uploader"] = {}
_REGISTRY_LOCK = threading.Lock()
#: per spool folder, the generation of the newest front built for it in this process: a front that
#: a newer one replaced (a notebook cell run again) does not wait for uploads when it is closed
_NEWEST_FRONT: Dict[str, int] = {}
_generation = iter(range(1, 1 << 62))


class Uploader:
    """Copies the checkpoints of one :class:`Spool` to their destination store, in a daemon thread.

    One per spool folder and process (the fronts of re-run notebook cells share it). Never gives up
    while the process lives; ``fatal`` is set (and uploads stop) only when the run belongs to another
    session (:class:`RunLockedError` / :class:`LeaseLostError`).
    """

    def __init__(self, spool: Spool, dest: CheckpointStore, *, takeover: bool = False,
                 bars: bool = True, progress: Optional[Callable[[int], None]] = None,
                 mount: Optional[MountWatch] = None):
        self.spool = spool
        self.dest = dest
        self.takeover = takeover
        self.bars = bars
        self.progress = progress
        # the watch recorded when the destination was first seen (a later one could anchor above a
        # mount that is already gone)
        self.mount = mount if mount is not None else (MountWatch(dest.path) if dest.backend.local else None)
        self.lock = threading.RLock()          # held while the destination is used (uploads, direct commits)
        self.spool_lock = threading.Lock()     # choosing / dropping spooled checkpoints
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._next_dest: Optional[CheckpointStore] = None
        self._want_open = False
        self._stop = False
        self.fronts: List["SpooledStore"] = []
        self.closing = False
        self.exited = False
        self.fatal: Optional[BaseException] = None
        self.opened = threading.Event()        # an attempt to open the destination has finished
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
        self._wake.set()

    def want_open(self) -> None:
        """Open the destination (take its writer lease) at the next pass, even with nothing pending."""
        self._want_open = True
        self.opened.clear()
        self.notify()

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

    # ------------------------------------------------------------------------------- waiting
    def pending(self) -> List[CheckpointInfo]:
        try:
            return self.spool.pending()
        except OSError:
            return []

    def drained(self) -> bool:
        return self.in_flight is None and not self.pending()

    def wait_drained(self, timeout: Optional[float]) -> bool:
        """Wait until the spool is empty (True) or ``timeout`` seconds pass / uploads stop (False)."""
        self.notify()  # a flush cuts a backoff short: try now
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.drained():
                return True
            if self.fatal is not None or (self.exited and not self.alive):
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            with self._cond:
                self._cond.wait(0.25 if left is None else min(0.25, left))

    # ---------------------------------------------------------------------------------- loop
    def _run(self) -> None:
        delay = BACKOFF_INITIAL
        try:
            while not self._stop and self.fatal is None:
                self._wake.clear()
                try:
                    with self.lock:
                        touched, worked = self._pass()
                except (RunLockedError, LeaseLostError) as exc:
                    self._set_fatal(exc)
                    break
                except _SourceGone:
                    continue
                except Exception as exc:  # noqa: BLE001 - every storage fault is retried
                    self._fault(exc)
                    self.opened.set()
                    self._wake.wait(delay * (0.5 + random.random()))
                    delay = min(delay * 2, BACKOFF_MAX)
                    continue
                finally:
                    with self._cond:
                        self._cond.notify_all()
                delay = BACKOFF_INITIAL
                if touched:
                    self._recovered()
                if worked:
                    continue
                with _REGISTRY_LOCK:
                    if self.closing and not self.fronts and not self.pending():
                        self._retire()
                        break
                self._wake.wait(IDLE_POLL)
        finally:
            with _REGISTRY_LOCK:
                self._retire()
            if self.fatal is None:
                try:
                    self.dest.close()  # the writer lease: released once nothing is left to upload
                except Exception as exc:  # noqa: BLE001
                    log.debug("could not release the lease of %s: %s", self.dest.url, exc)
            self.opened.set()
            with self._cond:
                self._cond.notify_all()

    def _retire(self) -> None:
        """Leave the registry (caller holds ``_REGISTRY_LOCK``): fronts attach to a new one now."""
        self.exited = True
        if _REGISTRY.get(self.spool.folder) is self:
            del _REGISTRY[self.spool.folder]

    def _pass(self) -> Tuple[bool, bool]:
        """One round: ``(touched the destination successfully, uploaded or dropped something)``."""
        if self._next_dest is not None:
            self.dest, self._next_dest = self._next_dest, None
        if self._want_open and self.dest.lease.held:
            self._want_open = False
            self.opened.set()
        pending = self.pending()
        touched = False
        if not pending and not (self._want_open and not self.dest.lease.held):
            return False, False
        if self.mount is not None:
            self.mount.check()
        if not self.dest.lease.held:
            self._open_dest()
            touched = True
        self._want_open = False
        self.opened.set()
        if not pending:
            return touched, False
        with self.spool_lock:
            pending = self.pending()
            for bad in [c for c in pending if c.error]:
                log.warning("spooled checkpoint %s is damaged (%s); removing it", bad.name, bad.error)
                self._drop(bad)
            pending = [c for c in pending if not c.error]
            self.dest_known = [c for c in self.dest.list() if c.error is None]
            self._trim_cache(self.dest_known)
            touched = True
            keep = []
            for c in pending:
                if self.superseded(c, pending, self.dest_known):
                    log.info("not uploading %s: %s newer checkpoint(s) supersede it (keep=%s)",
                             c.name, self.dest.keep, self.dest.keep)
                    self._drop(c)
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

    def _open_dest(self) -> None:
        lease = self.dest.lease.read()
        ours = bool(lease) and lease.get("host") == socket.gethostname() and lease.get("pid") == os.getpid()
        # ``ours``: an earlier front of this very process (a notebook cell run again) holds it
        self.dest.open_for_writing(takeover=self.takeover or ours)
        newest = self.dest.newest_committed()
        if newest is not None and newest.seq:
            self.spool.seq_floor = max(self.spool.seq_floor, newest.seq)
            for front in list(self.fronts):
                if front.spool is not None:
                    front.spool.seq_floor = max(front.spool.seq_floor, newest.seq)

    def _trim_cache(self, at_dest: Optional[Sequence[CheckpointInfo]] = None) -> None:
        """Keep the newest uploaded checkpoint as the local cache, drop older uploaded ones (and one
        the destination no longer has: deleted there on purpose)."""
        cached = sorted(self.spool.cached(), key=_order)
        names = None if at_dest is None else {c.name for c in at_dest}
        for i, c in enumerate(cached):
            if i < len(cached) - 1 or (names is not None and c.name not in names):
                self._drop(c)

    def _drop(self, c: CheckpointInfo) -> None:
        try:
            self.spool.remove(c)
        except OSError as exc:
            log.warning("could not remove spooled %s: %s", c.path, exc)

    # -------------------------------------------------------------------------------- upload
    def _bar(self, c: CheckpointInfo, total: int):
        if not self.bars:
            return _NullBar()
        try:
            from .progress import min_upload_bytes, setting

            if setting() is False or total < min_upload_bytes():
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
        with self.spool_lock:
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
            log.warning("retention at %s failed: %s", self.dest.url, exc)
        log.info("uploaded %s (%s) to %s in %.1f s", c.name, format_bytes(c.size_bytes), self.dest.url, seconds)
        for front in list(self.fronts):
            front._uploaded(c, seconds)

    def _copy(self, src: str, dst: str, bar) -> None:
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
        what = _describe(exc)
        self.last_error = what
        if self.failing is not None:
            log.info("upload to %s still failing: %s", self.dest.url, what)
            return
        self.failing, self.failing_since = what, time.time()
        self._report_outage(exc)

    def _report_outage(self, exc: BaseException) -> None:
        if self._outage_reported:
            return
        self._outage_reported = True
        n = len(self.pending())
        where = f"{n} checkpoint(s) wait" if n else "checkpoints wait"
        if _is_mount_error(exc, self.dest.backend.local):
            reason = getattr(exc, "reason", None) or _describe(exc)
            _say(f"the checkpoint folder {self.dest.url} is not reachable ({reason}). Training goes "
                 f"on; {where} on this machine's disk in {self.spool.folder} and are uploaded as soon "
                 f"as it is back. On Colab remount Drive: {REMOUNT_HINT}", logging.ERROR)
            return
        hint = ""
        code = getattr(exc, "errno", None)
        if code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            hint = " The destination is full: free space (on Drive: empty the bin, check the quota)."
        elif code == errno.EIO and self.mount is not None and self.mount.drive:
            hint = " On Drive, Errno 5 often means the storage quota is used up."
        _say(f"cannot upload checkpoints to {self.dest.url} ({_describe(exc)}). Training goes on; "
             f"{where} on this machine's disk in {self.spool.folder} and are retried with backoff "
             f"(up to {BACKOFF_MAX:.0f} s apart).{hint}", logging.ERROR)

    def _recovered(self) -> None:
        if self.failing is None:
            return
        took = time.time() - (self.failing_since or time.time())
        self.failing = self.failing_since = None
        if self._outage_reported:
            self._outage_reported = False
            n = len(self.pending())
            _say(f"{self.dest.url} works again (after {format_duration(took)}); "
                 f"{'uploading ' + str(n) + ' pending checkpoint(s)' if n else 'nothing left to upload'}",
                 logging.WARNING)
            try:
                self.dest.collect_garbage()  # folders of writes the outage cut short
            except OSError as exc:
                log.debug("garbage collection at %s failed: %s", self.dest.url, exc)

    def _set_fatal(self, exc: BaseException) -> None:
        self.fatal = exc
        self.opened.set()
        _say(f"stopped uploading to {self.dest.url}: {exc} Spooled checkpoints stay in "
             f"{self.spool.folder}.", logging.ERROR)


# --------------------------------------------------------------------------------- the front
class SpooledStore:
    """What the checkpointer's writer commits through: the destination directly, or the spool plus
    the background uploader (see the module docstring for when). Offers the writer-facing part of
    :class:`CheckpointStore` (``url``, ``run``, ``commit``, ``open_for_writing``, ``close``) plus
    :meth:`flush` and :meth:`resume_stores`."""

    def __init__(self, dest: CheckpointStore, spool: Union[str, bool, None] = "auto", *,
                 storage_options: Optional[dict] = None, flush_timeout: Optional[float] = None,
                 drive_flush: Optional[bool] = None, root: Optional[str] = None,
                 max_bytes: Union[int, str, None] = None, slow_seconds: Optional[float] = None,
                 quiet: bool = False, remaining_fn: Optional[Callable[[], Optional[float]]] = None,
                 on_durable: Optional[Callable[[float], None]] = None):
        self.dest = dest
        self.url = dest.url
        self.run = dest.run
        self.mode = resolve_mode(spool)
        self.storage_options = storage_options
        self.flush_timeout = (float(flush_timeout) if flush_timeout is not None
                              else _env_float(ENV_FLUSH, DEFAULT_FLUSH_TIMEOUT))
        self.drive_flush = _env_flag(ENV_DRIVE_FLUSH) if drive_flush is None else bool(drive_flush)
        self.slow_seconds = slow_seconds if slow_seconds is not None else _env_float(ENV_SLOW, DEFAULT_SLOW_SECONDS)
        self.quiet = quiet
        self.remaining_fn = remaining_fn
        self.on_durable = on_durable
        self.root = root
        self.folder = spool_dir_for(dest.url, dest.run, root)
        self._max_bytes = max_bytes if max_bytes is not None else os.environ.get(ENV_MAX) or None
        self.local = dest.backend.local
        self.drive = self.local and is_drive_path(dest.path)
        self.mount = MountWatch(dest.path) if self.local else None
        self.spool: Optional[Spool] = None
        self.uploader: Optional[Uploader] = None
        self.takeover = False
        # why the spool is in use: "destination" (remote / Drive / forced), "failure", "slow", None
        self.reason: Optional[str] = None
        remote = not self.local and dest.url.split("://", 1)[0] not in _IN_PROCESS
        if self.mode == "always" or (self.mode == "auto" and (remote or self.drive)):
            self.reason = "destination"
            if dest.retry == RetryPolicy():
                # The uploader retries for ever with its own backoff; the store's retries (5 attempts,
                # up to 5 s apart) would only delay a resume that can fall back to the spool.
                dest.retry = RetryPolicy(attempts=3, initial_delay=0.2, max_delay=1.0)
        elif self.mode == "auto" and os.path.isdir(self.folder) and self._spool().has_pending():
            self.reason = "failure"  # left over from an earlier session: upload those first
        with _REGISTRY_LOCK:
            self._generation = next(_generation)
            _NEWEST_FRONT[self.folder] = self._generation
        self._bound_warned = False
        self._stuck_at: Optional[int] = None
        self._end_done = False
        self._synced_said = False

    @property
    def spooling(self) -> bool:
        return self.reason is not None

    # ------------------------------------------------------------------------------ plumbing
    def _spool(self) -> Spool:
        if self.spool is None:
            self.spool = Spool(self.folder, self.dest.url, self.dest.run)
        return self.spool

    @property
    def max_bytes(self) -> int:
        if self._max_bytes is None or isinstance(self._max_bytes, str):
            if self._max_bytes:
                self._max_bytes = parse_bytes(self._max_bytes)
            else:
                probe = self.folder
                while not os.path.exists(probe) and os.path.dirname(probe) != probe:
                    probe = os.path.dirname(probe)
                try:
                    self._max_bytes = shutil.disk_usage(probe).free // 2
                except OSError:
                    self._max_bytes = 10 ** 10
        return int(self._max_bytes)

    def _attach(self) -> Uploader:
        up = self.uploader
        if up is not None and up.alive and not up.exited and up.fatal is None:
            return up
        with _REGISTRY_LOCK:
            up = _REGISTRY.get(self.folder)
            if up is None or up.exited or up.fatal is not None:
                up = Uploader(Spool(self.folder, self.dest.url, self.dest.run), self.dest,
                              takeover=self.takeover, bars=not self.quiet, mount=self.mount)
                _REGISTRY[self.folder] = up
                up.start()
            elif up.dest is not self.dest:
                up._next_dest = self.dest  # this front's store (its lease, its progress) from now on
                up.takeover = self.takeover
            if self not in up.fronts:
                up.fronts.append(self)
            up.closing = False
            self.uploader = up
        return up

    def _open_spool(self) -> Spool:
        spool = self._spool()
        if not spool.lease.held:
            spool.write_record(self.dest, self.storage_options)
            spool.open_for_writing()
        return spool

    def _switch(self, exc: BaseException, doing: str) -> None:
        """Direct writing failed: spool from now on, and say so once (the uploader then only reports
        when the destination works again)."""
        self.reason = "failure"
        seq = getattr(self.dest, "_seq", None)
        if seq:  # the direct commits' count: spooled manifests continue it
            self._spool().seq_floor = max(self._spool().seq_floor, seq)
        up = self._attach()
        if up.failing is None:
            up.failing, up.failing_since = _describe(exc), time.time()
            up._outage_reported = True
            if _is_mount_error(exc, self.local):
                advice = f"; on Colab remount Drive: {REMOUNT_HINT}"
            else:
                advice = ""
            _say(f"{doing} at {self.url} failed ({getattr(exc, 'reason', None) or _describe(exc)}). "
                 f"Training goes on; checkpoints are committed to this machine's disk in {self.folder} "
                 f"and uploaded in the background as soon as the destination works again{advice}",
                 logging.ERROR)

    # ------------------------------------------------------------------------ writer-facing API
    def open_for_writing(self, takeover: bool = False) -> None:
        self.takeover = takeover
        if not self.spooling:
            try:
                if self.mount is not None:
                    self.mount.check()
                self.dest.open_for_writing(takeover=takeover)
                return
            except RunLockedError:
                raise
            except OSError as exc:
                if self.mode == "never" or (getattr(exc, "errno", None) in _CONFIG_ERRNOS
                                            and not _is_mount_error(exc)):
                    raise
                self._switch(exc, "opening the run")
        self._open_spool()
        up = self._attach()
        up.want_open()
        if up.failing is None:
            up.opened.wait(OPEN_TIMEOUT)
        if isinstance(up.fatal, RunLockedError):
            raise up.fatal

    def commit(self, files, *, step: int, epoch: Optional[int] = None,
               metadata: Optional[Mapping[str, Any]] = None,
               progress: Optional[Callable[[int], None]] = None) -> WriteResult:
        up = self.uploader
        if up is not None and up.fatal is not None:
            # the run belongs to another session now: stop writing to it (the writer re-raises this)
            raise up.fatal if isinstance(up.fatal, LeaseLostError) else LeaseLostError(str(up.fatal))
        if self.reason == "failure" and up is not None and up.failing is None and up.last_ok and up.drained():
            self.reason = None
            if hasattr(self.dest, "_seq"):
                self.dest._seq = None  # count on from what was uploaded meanwhile
            _say(f"writing checkpoints directly to {self.url} again", logging.WARNING)
        if not self.spooling:
            try:
                if self.mount is not None:
                    self.mount.check()
                if up is not None:
                    with up.lock:
                        result = self.dest.commit(files, step=step, epoch=epoch, metadata=metadata,
                                                  progress=progress)
                else:
                    result = self.dest.commit(files, step=step, epoch=epoch, metadata=metadata,
                                              progress=progress)
            except (LeaseLostError, RunLockedError):
                raise
            except OSError as exc:
                if self.mode == "never":
                    raise
                self._switch(exc, f"writing the checkpoint of step {step}")
            else:
                if self.mode == "auto" and result.seconds > self.slow_seconds:
                    self.reason = "slow"
                    _say(f"writing step {step} to {self.url} took {result.seconds:.1f} s; from now on "
                         f"checkpoints are committed to local disk ({self.folder}) and uploaded in the "
                         "background so training does not wait for it", logging.WARNING)
                    self._open_spool()
                    self._attach()
                return result
        spool = self._open_spool()
        up = self._attach()
        spool.seq_floor = max(spool.seq_floor, up.spool.seq_floor)
        try:
            result = spool.commit(files, step=step, epoch=epoch, metadata=metadata, progress=progress)
        except (LeaseLostError, RunLockedError):
            raise
        except OSError as exc:
            # The spool's own disk failed (full?): the destination directly is the last resort.
            log.error("spooling step %d to %s failed (%s); writing it to %s directly", step,
                      spool.url, _describe(exc), self.url)
            with up.lock:
                if not self.dest.lease.held:
                    self.dest.open_for_writing(takeover=self.takeover)
                return self.dest.commit(files, step=step, epoch=epoch, metadata=metadata, progress=progress)
        up.spool.seq_floor = max(up.spool.seq_floor, spool.seq_floor)
        up.notify()
        self._enforce_bound(up)
        return result

    def _enforce_bound(self, up: Uploader) -> None:
        limit = self.max_bytes
        with up.spool_lock:
            everything = up.spool.list()
            total = sum(c.size_bytes or 0 for c in everything)
            if total <= limit:
                self._bound_warned = False
                return
            for c in everything:  # uploaded copies (the local cache) go first: they are at the destination
                if total > limit and getattr(c, "cache", False):
                    up._drop(c)
                    total -= c.size_bytes or 0
            pending = [c for c in everything if not getattr(c, "cache", False)]
            for c in pending[:-1]:  # oldest first, never the newest
                if total <= limit:
                    break
                if c.name == up.in_flight or not up.superseded(c, pending, up.dest_known):
                    continue
                up._drop(c)
                up.dropped += 1
                total -= c.size_bytes or 0
                log.warning("spool over its bound (%s): dropped %s, which %s newer checkpoint(s) "
                            "supersede (retention would remove it)", format_bytes(limit), c.name,
                            self.dest.keep)
            if total > limit and not self._bound_warned:
                self._bound_warned = True
                _say(f"the spool {self.folder} holds {format_bytes(total)}, over its bound of "
                     f"{format_bytes(limit)} ({ENV_MAX}); every spooled checkpoint is kept because none "
                     f"is superseded by keep={self.dest.keep} newer ones. Free disk space or fix the "
                     f"destination {self.url}.", logging.WARNING)

    def _uploaded(self, info: CheckpointInfo, seconds: float) -> None:
        if self.on_durable is not None:
            try:
                self.on_durable(seconds)
            except Exception as exc:  # noqa: BLE001
                log.debug("on_durable failed: %s", exc)

    # --------------------------------------------------------------------------------- flush
    def pending(self) -> List[CheckpointInfo]:
        if self.uploader is not None:
            return self.uploader.pending()
        if self.spool is not None or os.path.isdir(self.folder):
            try:
                return self._spool().pending()
            except OSError:
                return []
        return []

    def wait_uploaded(self, timeout: Optional[float]) -> bool:
        if not self.pending():
            return True
        return self._attach().wait_drained(timeout)

    def flush(self, timeout: Optional[float] = None, *, end_of_run: bool = False) -> bool:
        """Wait (bounded) until every spooled checkpoint is uploaded; on Colab with a Drive
        destination also sync (and at the end of a run flush Drive when asked). True when nothing
        is left to upload."""
        ok = True
        if _NEWEST_FRONT.get(self.folder) != self._generation:
            return True  # replaced by a newer front for this run: its uploads go on there
        if self.pending():
            up = self._attach()
            bound = self.flush_timeout if timeout is None else float(timeout)
            remaining = self.remaining_fn() if self.remaining_fn is not None else None
            if remaining is not None:
                bound = min(bound, max(0.0, remaining - 5.0))
            if self._stuck_at is not None and self._stuck_at == up.uploaded and up.failing is not None:
                bound = min(bound, 1.0)  # an earlier flush timed out and nothing has moved since
            first = min(bound, 2.0)
            ok = up.wait_drained(first)
            if not ok and bound > first:
                pending = self.pending()
                _say(f"waiting up to {format_duration(bound)} for {len(pending)} checkpoint "
                     f"upload(s) ({format_bytes(sum(c.size_bytes or 0 for c in pending))}) to {self.url}")
                ok = up.wait_drained(bound - first)
            if ok:
                self._stuck_at = None
            else:
                if self._stuck_at != up.uploaded:
                    self._report_pending(up)
                self._stuck_at = up.uploaded
        if self.drive and _on_colab():
            self._drive_sync(end_of_run, ok)
        return ok

    def _report_pending(self, up: Uploader) -> None:
        pending = self.pending()
        if not pending:
            return
        oldest = min((c.created for c in pending if c.created), default=time.time())
        why = f" ({up.last_error})" if up.failing and up.last_error else ""
        _say(f"{len(pending)} checkpoint(s) ({format_bytes(sum(c.size_bytes or 0 for c in pending))}, "
             f"oldest {format_duration(time.time() - oldest)} old, newest step {pending[-1].step}) are "
             f"not uploaded to {self.url} yet{why}. They are safe on this machine's disk in "
             f"{self.folder} (not if the VM itself is recycled); uploads go on while this process "
             f"lives. After a restart, running the training again resumes from them and uploads "
             f"them, or run: keepalive sync {self.url}", logging.WARNING)

    def _drive_sync(self, end_of_run: bool, uploaded: bool = True) -> None:
        try:
            os.sync()
        except (AttributeError, OSError) as exc:  # pragma: no cover - os.sync is POSIX
            log.debug("os.sync failed: %s", exc)
        if not self._synced_said:
            self._synced_said = True
            log.info("os.sync() done: the Drive mount has every checkpoint byte; Drive uploads them "
                     "in the background")
        if not end_of_run or self._end_done:
            return
        if self.drive_flush and not uploaded:
            _say("not unmounting Drive yet: checkpoint uploads to it are still pending (see above)",
                 logging.WARNING)
            return
        self._end_done = True
        if self.drive_flush:
            try:
                from google.colab import drive  # the one Colab-only module used here

                drive.flush_and_unmount()
                _say("flushed Google Drive and unmounted it (drive_flush=True), so every checkpoint "
                     f"has reached Drive. Mount it again to keep using it: {REMOUNT_HINT}")
            except Exception as exc:  # noqa: BLE001
                _say(f"drive.flush_and_unmount() failed ({_describe(exc)}); Drive still syncs in the "
                     "background", logging.WARNING)
        else:
            _say("checkpoints are on the Drive mount, which uploads them to Google Drive in the "
                 "background (minutes for large files). Before this runtime ends, run "
                 "`from google.colab import drive; drive.flush_and_unmount()` to be sure they reached "
                 "Drive, or pass drive_flush=True (KEEPALIVE_DRIVE_FLUSH=1) to do it at the end of "
                 "training.")

    def close(self) -> None:
        """Release the spool's lease; uploads go on in the background until the spool is empty,
        then the destination's lease is released too."""
        if self.spool is not None:
            self.spool.close()
        up = self.uploader
        if up is None:
            self.dest.close()
            return
        with _REGISTRY_LOCK:
            if self in up.fronts:
                up.fronts.remove(self)
            if not up.fronts:
                up.closing = True
        up.notify()
        self.uploader = None

    # -------------------------------------------------------------------------------- resume
    def resume_stores(self) -> List[CheckpointStore]:
        """Where a resume looks: the spool (when it exists) first, then the destination."""
        if os.path.isdir(os.path.join(self.folder, self.dest.run)):
            return [self._spool(), self.dest]
        return [self.dest]


# ------------------------------------------------------------------------------ keepalive sync
def _matches(dest: str, wanted: Optional[str]) -> bool:
    if wanted is None:
        return True
    from .backends import backend_for

    try:
        backend, path = backend_for(wanted)
        url = backend.url(path).rstrip("/")
    except Exception:  # noqa: BLE001 - an unknown protocol: compare the text
        url = wanted.rstrip("/")
    return dest == url or dest.startswith(url + "/")


def sync(path: Optional[str] = None, *, timeout: Optional[float] = None, root: Optional[str] = None,
         progress: Optional[Callable[[int], None]] = None,
         storage_options: Optional[dict] = None) -> Dict[str, Any]:
    """Upload what waits in the spool (for the destination ``path``, or every destination), from
    any process. Returns ``{"ok": bool, "destinations": [{destination, pending_before, uploaded,
    pending, error}]}``; ``ok`` is False when something is still pending."""
    results = []
    deadline = None if timeout is None else time.monotonic() + timeout
    for folder, record in list_spools(root):
        dest_url = record["destination"]
        if not _matches(dest_url, path):
            continue
        spool = _spool_of(folder, record)
        before = spool.pending()
        row: Dict[str, Any] = {"destination": dest_url, "spool": folder, "pending_before": len(before),
                               "bytes_before": sum(c.size_bytes or 0 for c in before), "uploaded": 0,
                               "pending": len(before), "error": None}
        results.append(row)
        if not before:
            continue
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        lease = spool.lease.read()
        if spool.lease.is_live(lease):
            # the training process is alive and uploads them itself: wait for it
            log.info("process %s on %s owns %s; waiting for its uploads", lease.get("pid"),
                     lease.get("host"), folder)
            end = None if left is None else time.monotonic() + left
            while spool.pending() and (end is None or time.monotonic() < end):
                time.sleep(0.5)
            row["pending"] = len(spool.pending())
            row["uploaded"] = max(0, len(before) - row["pending"])
            if row["pending"]:
                row["error"] = (f"process {lease.get('pid')} still owns this spool and has not finished "
                                "uploading")
            continue
        options = dict(record.get("storage_options") or {})
        options.update(storage_options or {})
        try:
            dest = CheckpointStore(dest_url, keep=record.get("keep"), keep_every=record.get("keep_every"),
                                   storage_options=options or None)
            spool.open_for_writing()
        except Exception as exc:  # noqa: BLE001
            row["error"] = _describe(exc)
            continue
        up = Uploader(spool, dest, bars=False, progress=progress)
        up.start()
        try:
            up.want_open()
            up.wait_drained(left)
        finally:
            up.stop(timeout=10.0)
            spool.close()
        row["pending"] = len(spool.pending())
        row["uploaded"] = up.uploaded
        row["dropped"] = up.dropped
        if row["pending"]:
            row["error"] = up.last_error or (str(up.fatal) if up.fatal else "timed out")
    return {"ok": all(not r["pending"] for r in results), "destinations": results}


__all__ = [
    "Spool", "Uploader", "SpooledStore", "MountWatch", "MountVanished", "spool_root", "spool_dir_for",
    "resolve_mode", "pending_summary", "format_pending", "list_spools", "sync", "parse_bytes",
]
