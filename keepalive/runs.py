"""Runs: the one place that knows which runs exist and which checkpoints each one holds.

A run is its **destination** (the run folder: a local path or an fsspec URL) plus, on this machine,
its **local spool** (checkpoints committed locally and not uploaded yet, and the local copy of the
newest uploaded one: :mod:`keepalive.spool`). Resume (:meth:`keepalive.core.Checkpointer.load`),
``keepalive ls`` / ``verify`` / ``sync`` / ``status``, ``%keepalive ls``, ``%resume_training`` and the
notice of ``%load_ext keepalive`` all ask this module; nothing else lists runs or picks a checkpoint.

Rules, once:

* A run's checkpoints are those of its destination and of its spool, newest first by (step, time
  saved). A checkpoint held by both is listed once (the destination's copy); a resume reads the
  spool's copy first (local disk) and falls back to the other.
* A spooled copy that was uploaded already (``cached``) counts only where the destination holds it
  too, or where the destination cannot be read: a run deleted at the destination on purpose does not
  come back from a cache.
* The newest *valid* checkpoint is the newest that verifies, falling back past damaged ones.

>>> from keepalive.store import CheckpointStore
>>> store = CheckpointStore("memory://doc-runs/pets", keep=None)
>>> for step in (3, 6):
...     _ = store.commit({"a.bin": b"x"}, step=step, epoch=step // 3)
>>> store.close()
>>> run = open_run("memory://doc-runs/pets")
>>> [c.step for c in run.checkpoints()], run.newest_valid().step
([6, 3], 6)
>>> [r.name for r in find_runs("memory://doc-runs")]
['pets']
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from . import report
from .backends import local_path
from .errors import NoCheckpointError
from .spool import Spool, list_spools
from .state import STATE_FILE, TENSOR_FILE, from_files
from .store import (
    CKPT_PREFIX,
    CheckpointInfo,
    CheckpointStore,
    backend_for,
    checksum_bytes,
    first_readable,
    is_at_or_below,
    run_folders_below,
)
from .units import format_bytes, format_duration

__all__ = ["Run", "Location", "resuming_line", "read_from", "position", "open_run", "find_runs", "spooled_runs",
           "locate", "checkpoints_at", "read_state", "pending_summary", "format_pending", "RUN_INDEX", "record_run",
           "read_run_index", "indexed_runs", "answered_within", "RUN_RECORDS"]

log = logging.getLogger("keepalive.runs")

Copy = Tuple[CheckpointInfo, CheckpointStore]  # a checkpoint and the store holding this copy of it


def read_state(info: CheckpointInfo, store: CheckpointStore) -> Dict[str, Any]:
    """The state tree of checkpoint ``info`` held by ``store``; raises
    :class:`~keepalive.errors.CheckpointCorruptError` when any byte differs from its manifest (every
    file is checked; only the state's own two are kept in memory, not an FSDP2 checkpoint's shards).

    Verification reads every byte once (the checksum pass) and the same buffers then become the
    state's tensors, so a resume costs one pass over the checkpoint. Nothing from a checkpoint is
    executed: the state is JSON plus raw tensor bytes (:mod:`keepalive.state`)."""
    return from_files(store.read_files(info, only=(STATE_FILE, TENSOR_FILE)), info.url)


@dataclass
class _Listing:
    """What listing a run's stores found: every copy, newest first, and the stores that failed."""

    copies: List[Copy] = field(default_factory=list)
    failed: List[Tuple[str, BaseException]] = field(default_factory=list)  # (url, error)
    answered: List[CheckpointStore] = field(default_factory=list)


class Run:
    """One training run: its destination store and, when this machine has one, its local spool.

    Listing is lazy and taken once (a snapshot); :meth:`refresh` lists again. :meth:`load_newest`
    always lists afresh.
    """

    def __init__(self, destination: Union[CheckpointStore, str], *, spool: Optional[Spool] = None,
                 storage_options: Optional[dict] = None, name: Optional[str] = None):
        if isinstance(destination, CheckpointStore):
            self._destination: Optional[CheckpointStore] = destination
            self.url = destination.url
            self.name = name or destination.run
        else:  # a URL from a spool record: the store is built when first needed (it may be remote)
            self._destination = None
            self.url = destination.rstrip("/")
            self.name = name or self.url.rsplit("/", 1)[-1] or "run"
        self.storage_options = storage_options
        self.spool = spool
        self._snapshots: Dict[bool, _Listing] = {}

    def __repr__(self) -> str:
        return f"Run({self.url!r}{', with a local spool' if self.spool is not None else ''})"

    @property
    def run(self) -> str:
        """The run's name (its folder name), as :attr:`CheckpointStore.run` and
        :attr:`CheckpointInfo.run` call it."""
        return self.name

    @property
    def destination(self) -> CheckpointStore:
        """The run folder's store (read-only use: ``keep=None``, nothing is ever deleted through it)."""
        if self._destination is None:
            self._destination = CheckpointStore(self.url, keep=None, storage_options=self.storage_options)
        return self._destination

    # ------------------------------------------------------------------------------- listing
    def _list(self, include_uncommitted: bool = False) -> _Listing:
        listing = _Listing()
        stores: List[CheckpointStore] = [self.spool] if self.spool is not None else []
        try:
            stores.append(self.destination)
        except Exception as exc:  # noqa: BLE001 - e.g. a protocol whose package is not installed
            listing.failed.append((self.url, exc))
        for store in stores:
            try:
                listed = store.list(include_uncommitted)
            except Exception as exc:  # noqa: BLE001 - one store down: the other may answer
                listing.failed.append((store.url, exc))
                continue
            listing.answered.append(store)
            listing.copies.extend((info, store) for info in listed)
        held = {info.name for info, _ in listing.copies if not info.cached}
        listing.copies = [(info, store) for info, store in listing.copies
                          if listing.failed or not info.cached or info.name in held]
        if len(stores) > 1:
            # newest first by (step, time saved, name); for one checkpoint held twice, the spool first
            rank = {id(s): r for r, s in enumerate(stores)}
            listing.copies.sort(key=lambda c: (-(c[0].step if c[0].step is not None else -1),
                                               -(c[0].created or 0.0), c[0].name, rank[id(c[1])]))
        else:
            listing.copies.reverse()  # one store: exactly its own order (step, seq, created), newest first
        return listing

    def _snapshot(self, include_uncommitted: bool = False) -> _Listing:
        if include_uncommitted not in self._snapshots:
            self._snapshots[include_uncommitted] = self._list(include_uncommitted)
        return self._snapshots[include_uncommitted]

    def refresh(self) -> "Run":
        """Forget what was listed: the next question lists the stores again."""
        self._snapshots.clear()
        return self

    def store_of(self, info: CheckpointInfo) -> CheckpointStore:
        """The store that holds this copy of a checkpoint (the spool or the destination)."""
        return self.spool if info.source == "spool" and self.spool is not None else self.destination

    def checkpoints(self, verify: bool = False, include_uncommitted: bool = False) -> List[CheckpointInfo]:
        """The run's checkpoints, newest first, each once (``source`` says where this copy lies,
        ``cached`` marks the spool's copy of an uploaded one). ``verify``: re-read every committed
        one to fill in ``valid``; ``include_uncommitted``: also folders of writes that never finished.

        Raises the storage error when nothing could be listed (the destination cannot be read and
        the spool holds nothing).
        """
        listing = self._snapshot(include_uncommitted)
        if listing.failed and not listing.copies:
            raise listing.failed[0][1]
        at_destination = {info.name for info, store in listing.copies if info.source != "spool"}
        out: List[CheckpointInfo] = []
        seen = set()
        for info, _ in listing.copies:
            if info.name in seen or (info.source == "spool" and info.name in at_destination):
                continue
            seen.add(info.name)
            out.append(info)
        if verify:
            for info in out:
                if info.committed and info.error is None:
                    self.store_of(info).verify(info)
        return out

    def _readable(self) -> List[CheckpointInfo]:
        """Committed checkpoints whose manifests read, newest first; [] when nothing can be listed."""
        try:
            return [c for c in self.checkpoints() if c.error is None]
        except Exception:  # noqa: BLE001 - see ``error``
            return []

    @property
    def error(self) -> Optional[str]:
        """Why (part of) the run could not be listed, or None (from what was listed already)."""
        listings = list(self._snapshots.values()) or [self._snapshot()]
        failed = [exc for listing in listings for _, exc in listing.failed]
        return str(failed[0]) if failed else None

    @property
    def newest(self) -> Optional[CheckpointInfo]:
        """The newest committed checkpoint whose manifest reads (its data is not read)."""
        readable = self._readable()
        return readable[0] if readable else None

    @property
    def count(self) -> int:
        """How many committed checkpoints with a readable manifest the run has."""
        return len(self._readable())

    @property
    def broken(self) -> int:
        """How many committed checkpoints have a damaged manifest."""
        try:
            return sum(1 for c in self.checkpoints() if c.error is not None)
        except Exception:  # noqa: BLE001
            return 0

    # ---------------------------------------------------------------------- newest valid, resume
    def _copies_newest_first(self) -> List[Copy]:
        return [(info, store) for info, store in self._snapshot().copies if info.committed]

    def newest_valid(self, *, on_corrupt: Optional[Callable[[CheckpointInfo], None]] = None,
                     quiet: bool = False) -> Optional[CheckpointInfo]:
        """The newest checkpoint that verifies (every byte re-read), falling back past damaged ones
        (each handed to ``on_corrupt``, else reported as a warning); None when none verifies."""
        found = first_readable(self._copies_newest_first(), lambda info, store: store.check(info),
                               on_corrupt=on_corrupt, quiet=quiet)
        return found[0] if found else None

    def load_newest(self, *, quiet: bool = False
                    ) -> Optional[Tuple[CheckpointInfo, Dict[str, Any], Optional[dict]]]:
        """``(info, state tree, progress of the last writer)`` of the newest valid checkpoint, or None.

        Lists afresh. Damaged checkpoints (torn, truncated, bit-flipped) are skipped with a warning
        naming them. A store that cannot be listed (the destination is down) is skipped with a
        warning as long as another one answers; when none answers, or nothing readable is found and
        a store could not be read (it may hold more), its error is raised: starting over could bury
        its checkpoints.
        """
        listing = self.refresh()._snapshot()
        if listing.failed and listing.answered:
            for url, exc in listing.failed:
                report.warn(f"cannot read {url} ({exc}); looking for the newest checkpoint in the other "
                            "location(s)", quiet=quiet)
        if listing.failed and not listing.copies:
            raise listing.failed[0][1]
        previous = _writer_progress(listing.answered)
        found = first_readable(self._copies_newest_first(), read_state, quiet=quiet)
        if found is None:
            if listing.failed:
                raise listing.failed[0][1]  # all that could be read was damaged
            return None
        info, tree = found
        return info, tree, previous

    # ------------------------------------------------------------------------------- uploads
    def pending_uploads(self) -> List[CheckpointInfo]:
        """Checkpoints waiting in this machine's spool for upload, newest first."""
        if self.spool is None:
            return []
        try:
            return list(reversed(self.spool.pending()))
        except OSError:
            return []

    def in_spool(self, info: Optional[CheckpointInfo]) -> bool:
        """Whether ``info`` exists only in this machine's spool (committed here, not uploaded yet)."""
        return info is not None and info.source == "spool" and not info.cached

    # ---------------------------------------------------------------------- what the run says
    @property
    def metadata(self) -> Dict[str, Any]:
        """The metadata of the newest checkpoint (what the writer recorded: framework, cell, ...)."""
        newest = self.newest
        return ((newest.manifest or {}).get("metadata") or {}) if newest else {}

    @property
    def finished(self) -> bool:
        return bool(self.metadata.get("finished"))

    @property
    def unfinished(self) -> bool:
        return self.newest is not None and not self.finished

    @property
    def created(self) -> float:
        """When the newest checkpoint was saved (unix seconds; 0 without one)."""
        newest = self.newest
        return (newest.created or 0.0) if newest else 0.0

    def where(self, info: Optional[CheckpointInfo] = None) -> str:
        """``step S, E epoch(s) done (ckpt-..., saved 3 min ago)`` for ``info`` (default: the newest): a
        count of epochs, which no numbering can misread (the manifest does not say whether the step lies
        inside the next epoch)."""
        n = info or self.newest
        if n is None:
            return "no committed checkpoint"
        age = format_duration(max(0.0, time.time() - (n.created or time.time())))
        spooled = "; in the local spool, not uploaded yet" if self.in_spool(n) else ""
        return f"step {n.step}, {n.epoch or 0} epoch(s) done ({n.name}, saved {age} ago{spooled})"

    def writer_progress(self) -> Optional[dict]:
        """How far the last writer got (the counters in its lease's heartbeat), or None."""
        stores = ([self.spool] if self.spool is not None else []) + [self.destination]
        return _writer_progress(stores)

    def live_writer(self) -> Optional[Dict[str, Any]]:
        """The lease of another live session writing the run now (None when there is none, or when
        it is this process)."""
        lease = self.destination.lease
        try:
            current = lease.read()
        except Exception:  # noqa: BLE001
            return None
        if not current or not lease.is_live(current):
            return None
        if current.get("pid") == os.getpid() and current.get("host") == lease.host:
            return None
        return current

    def summary(self) -> Dict[str, Any]:
        """JSON-safe facts for ``keepalive status``: ``run``, ``url``, ``checkpoints``,
        ``newest`` / ``newest_step`` / ``newest_epoch`` / ``newest_created`` (UTC ISO) / ``world_size``
        / ``sharded`` (of the newest checkpoint: how many torch.distributed ranks wrote it, and whether
        in DCP shards), and when they apply ``broken``,
        ``pending_uploads`` and ``error``."""
        entry: Dict[str, Any] = {"run": self.name, "url": self.url, "newest_step": None,
                                 "newest_epoch": None, "newest_created": None, "checkpoints": 0}
        if self.error is not None:
            entry["error"] = self.error
        entry["checkpoints"] = self.count
        if self.broken:
            entry["broken"] = self.broken
        newest = self.newest
        if newest is not None:
            created = None if newest.created is None else time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                         time.gmtime(newest.created))
            entry.update(newest_step=newest.step, newest_epoch=newest.epoch, newest_created=created,
                         newest=newest.name, world_size=newest.world_size or 1, sharded=newest.sharded)
        pending = len(self.pending_uploads())
        if pending:
            entry["pending_uploads"] = pending
        return entry


def _writer_progress(stores: Iterable[CheckpointStore]) -> Optional[dict]:
    best: Optional[dict] = None
    for store in stores:
        try:
            progress = (store.lease.read() or {}).get("progress")
        except Exception:  # noqa: BLE001 - informative only
            continue
        if progress and (best is None or (progress.get("step") or 0) > (best.get("step") or 0)):
            best = progress
    return best


# ------------------------------------------------------------------------------- finding runs
def _spool_for(dest: CheckpointStore) -> Optional[Spool]:
    """The local spool of a destination run when one exists on this machine (else None)."""
    try:
        spool = Spool.for_destination(dest)
        return spool if os.path.isdir(spool.path) else None
    except Exception:  # noqa: BLE001 - an unreadable spool root: the destination only
        return None


def open_run(url: Union[str, "os.PathLike[str]"], storage_options: Optional[dict] = None) -> Run:
    """The run at ``url`` (a run folder, local path or URL), with its local spool when it has one."""
    dest = CheckpointStore(url, keep=None, storage_options=storage_options)
    return Run(dest, spool=_spool_for(dest), storage_options=storage_options)


def spooled_runs(below: Optional[str] = None, spool_root: Optional[str] = None) -> List[Run]:
    """The runs that have a spool on this machine (under the spool root ``spool_root``), or only
    those whose destination is the run or folder ``below`` or lies below it."""
    out = []
    for folder, record in list_spools(spool_root, below=below):
        options = record.get("storage_options") or None
        out.append(Run(record["destination"], spool=Spool.from_record(folder, record),
                       storage_options=options, name=record.get("run")))
    return out


def find_runs(root: Union[str, "os.PathLike[str]"], storage_options: Optional[dict] = None,
              include_spools: bool = True) -> List[Run]:
    """Every run at or below ``root`` (a folder or URL), in folder order; with ``include_spools``
    also the runs whose destination lies below ``root`` but so far exist only in this machine's
    spool (a kernel died before its first upload). Raises when ``root`` cannot be read at all."""
    urls = run_folders_below(root, storage_options=storage_options)
    runs = [open_run(url, storage_options) for url in urls]
    if include_spools:
        known = {r.url for r in runs}
        try:
            for run in spooled_runs(below=os.fspath(root)):
                if run.url not in known and run.newest is not None:
                    runs.append(run)
                    known.add(run.url)
        except Exception:  # noqa: BLE001 - the spool is a bonus; the destinations were listed
            pass
    return runs


@dataclass
class Location:
    """What a path names: one checkpoint (``kind="checkpoint"``, its run and ``checkpoint``), one
    run (``"run"``) or a folder of runs (``"root"``)."""

    kind: str
    runs: List[Run]
    checkpoint: Optional[CheckpointInfo] = None


def locate(url: Union[str, "os.PathLike[str]"], storage_options: Optional[dict] = None) -> Location:
    """What ``url`` names (a checkpoint folder, also as a bare ``ckpt-...`` name; a run folder; a
    folder of runs). Raises :class:`NoCheckpointError` where nothing is found."""
    text = os.fspath(url).rstrip("/")
    backend, path = backend_for(text, storage_options)
    base = path.rsplit("/", 1)[-1]
    if base.startswith(CKPT_PREFIX):
        # the parent from the backend path: a bare relative "ckpt-..." has no "/" in ``text``
        run = open_run(backend.url(path.rsplit("/", 1)[0]), storage_options)
        return Location("checkpoint", [run], run.destination.load_info(base))
    here = backend.url(path)
    if not backend.exists(path):
        spooled = [r for r in spooled_runs(below=text) if r.newest is not None]
        if not spooled:
            raise NoCheckpointError(f"{text} does not exist")
        return Location("run" if [r.url for r in spooled] == [here] else "root", spooled)
    runs = find_runs(text, storage_options)
    if runs and runs[0].url == here:
        return Location("run", runs[:1])
    if not runs:
        raise NoCheckpointError(f"no keepalive run or checkpoint under {text}")
    return Location("root", runs)


def checkpoints_at(url: Union[str, "os.PathLike[str]"], verify: bool = False,
                   storage_options: Optional[dict] = None) -> List[CheckpointInfo]:
    """Every checkpoint ``url`` names, as ``keepalive ls`` / ``verify`` show them: one checkpoint; or
    each run's checkpoints oldest first, folders of unfinished writes included. ``verify``: re-read
    every committed one to fill in ``valid``."""
    return checkpoints_of(locate(url, storage_options), verify)


def checkpoints_of(where: Location, verify: bool = False) -> List[CheckpointInfo]:
    """:func:`checkpoints_at` of what :func:`locate` found."""
    if where.checkpoint is not None:
        info = where.checkpoint
        return [where.runs[0].store_of(info).verify(info) if verify else info]
    out: List[CheckpointInfo] = []
    for run in where.runs:
        listed = run.checkpoints(verify=verify, include_uncommitted=True)
        if run.error is not None:
            report.warn(f"cannot read {run.url} ({run.error}); showing what this machine's spool holds")
        out.extend(reversed(listed))
    return out


# ---------------------------------------------------------------------------- the index of runs
#: The index of runs: a small JSON file in the default checkpoint dir (on Colab: on Drive), naming
#: every run opened for writing elsewhere, so that the first cell after a VM reset can find a run
#: created with an explicit path (``DriveCheckpoint("/content/drive/MyDrive/runs/x")``).
RUN_INDEX = "RUNS.json"
#: Each run also gets its own small record file in this folder next to ``RUNS.json``. Drive and
#: object stores have neither rename nor compare-and-swap (keepalive.backends), so two sessions
#: merging ``RUNS.json`` at the same moment can each write a copy without the other's run; the
#: per-run records cannot collide (one file per run, written whole), and a reader takes the union
#: of both. A torn file (a crash while writing it) fails its checksum and is ignored.
RUN_RECORDS = ".keepalive-runs"
_INDEX_FORMAT = "keepalive-run-index"
_INDEX_MAX = 500            # entries kept in RUNS.json, newest first (by when each run was last opened)
_INDEX_LOCK = threading.Lock()


def _seal(entries: Any) -> bytes:
    body = json.dumps(entries, sort_keys=True).encode()
    return json.dumps({"format": _INDEX_FORMAT, "checksum": checksum_bytes(body), "runs": entries},
                      sort_keys=True, indent=1).encode()


def _parse_index(raw: bytes) -> Optional[List[Dict[str, Any]]]:
    """The entries of one index or record file, None when it is torn or damaged (checksum)."""
    try:
        doc = json.loads(raw)
        entries = doc["runs"]
        body = json.dumps(entries, sort_keys=True).encode()
        if doc.get("format") != _INDEX_FORMAT or doc.get("checksum") != checksum_bytes(body):
            return None
        return [e for e in entries if isinstance(e, dict) and isinstance(e.get("url"), str)]
    except (ValueError, KeyError, TypeError):
        return None


def _record_name(url: str) -> str:
    return checksum_bytes(url.encode()) + ".json"


def read_run_index(index_dir: Union[str, "os.PathLike[str]"]) -> Dict[str, Dict[str, Any]]:
    """The runs recorded in ``index_dir``: ``{url: {url, run, opened, host}}``, the newest record of
    each, from ``RUNS.json`` and the per-run records; {} when there is none."""
    backend, path = backend_for(os.fspath(index_dir))
    raws: List[bytes] = []
    try:
        raws.append(backend.read_bytes(backend.join(path, RUN_INDEX)))
    except (FileNotFoundError, NotADirectoryError):
        pass
    records = backend.join(path, RUN_RECORDS)
    try:
        names = [e.name for e in backend.listdir(records) if e.name.endswith(".json")]
    except (FileNotFoundError, NotADirectoryError):
        names = []
    for name in names:
        try:
            raws.append(backend.read_bytes(backend.join(records, name)))
        except (FileNotFoundError, NotADirectoryError):
            continue
    merged: Dict[str, Dict[str, Any]] = {}
    for raw in raws:
        for entry in _parse_index(raw) or []:
            # an older keepalive recorded a relative path as given: read it from this folder, where
            # a notebook's kernel starts again after a reset
            entry = dict(entry, url=_absolute(entry["url"]))
            old = merged.get(entry["url"])
            if old is None or float(entry.get("opened") or 0) > float(old.get("opened") or 0):
                merged[entry["url"]] = entry
    return merged


def _absolute(url: str) -> str:
    """A local run's absolute path (what a store names it by; a relative path in the index would name
    another folder in a process started elsewhere); a URL as it is."""
    return local_path(url) or url


def _gone(entry: Mapping[str, Any]) -> bool:
    """A local run folder that no longer exists (deleted on purpose): drop it from the index."""
    url = entry["url"]
    return "://" not in url and not os.path.isdir(url)


def record_run(url: str, index_dir: Union[str, "os.PathLike[str]", Callable[[], Optional[str]], None]) -> bool:
    """Note in the index of runs in ``index_dir`` that the run ``url`` was opened for writing.

    Called by the core when it takes a run's writer lease. Runs in ``index_dir`` itself (found by
    listing it) and ``memory://`` runs (gone with the process) are not recorded; ``index_dir=None``
    records nothing; a function is called (inside the guard) for the folder. Writes the run's own
    record file, then merges it into ``RUNS.json`` (read, add, write back; local runs deleted since
    are dropped). Never raises: a run trains whether or not it could be recorded (a failure is
    reported once). Returns whether the run was recorded.
    """
    if url.startswith("memory://"):
        return False
    url = _absolute(url)
    try:
        if callable(index_dir):
            index_dir = index_dir()
        if index_dir is None:
            return False
        if is_at_or_below(url, index_dir):
            return False
        entry = {"url": url, "run": url.rstrip("/").rsplit("/", 1)[-1], "opened": time.time(),
                 "host": socket.gethostname()}
        backend, path = backend_for(os.fspath(index_dir))
        records = backend.join(path, RUN_RECORDS)
        with _INDEX_LOCK:
            backend.makedirs(records)
            backend.write_bytes(backend.join(records, _record_name(url)), _seal([entry]))
            entries = read_run_index(index_dir)
            entries[url] = entry
            gone = [e for e in entries.values() if e["url"] != url and _gone(e)]
            for e in gone:
                backend.remove_file(backend.join(records, _record_name(e["url"])))
            kept = sorted((e for e in entries.values() if e not in gone),
                          key=lambda e: -float(e.get("opened") or 0))[:_INDEX_MAX]
            backend.write_bytes(backend.join(path, RUN_INDEX), _seal(kept))
        return True
    except Exception as exc:  # noqa: BLE001 - the index is a convenience; training goes on
        report.warn(f"could not record run {url} in the index of runs in {index_dir} ({exc}): after a "
                    f"reset, %load_ext keepalive will not name it (%resume_training {url} still resumes it)",
                    key=f"run-index:{index_dir}")
        return False


def indexed_runs(index_dir: Union[str, "os.PathLike[str]"], exclude_below: Optional[str] = None,
                 limit: Optional[int] = 50) -> List[Run]:
    """The runs the index in ``index_dir`` names (without those whose local folder is gone, and
    those at or below ``exclude_below``: listed there already), most recently opened first, at most
    ``limit`` of them. Nothing is listed yet: each run lists its stores when first asked (see
    :func:`answered_within`)."""
    try:
        entries = sorted(read_run_index(index_dir).values(), key=lambda e: -float(e.get("opened") or 0))
    except Exception as exc:  # noqa: BLE001 - an unreadable index: the runs in the dir only
        log.debug("cannot read the index of runs in %s: %s", index_dir, exc)
        return []
    try:
        spooled = {r.url: r for r in spooled_runs()}
    except Exception:  # noqa: BLE001 - an unreadable spool root: the destinations only
        spooled = {}
    out = []
    for e in entries:
        if _gone(e) or (exclude_below is not None and is_at_or_below(e["url"], exclude_below)):
            continue
        # its store is built when first listed (a remote one may be slow to set up)
        out.append(spooled.get(e["url"]) or Run(e["url"], name=e.get("run")))
        if limit is not None and len(out) >= limit:
            break
    return out


def answered_within(runs: Iterable[Run], timeout: float, workers: int = 8) -> Tuple[List[Run], List[Run]]:
    """``(answered, silent)``: list each run's stores in background threads (at most ``workers``
    at a time), waiting ``timeout`` seconds in all; a run on a store that does not answer by then
    (no network, a credential prompt) is ``silent`` and left alone, so a notebook's first cell
    never hangs on it. The order of ``runs`` is kept."""
    runs = list(runs)
    done: Dict[int, bool] = {}
    pending = list(reversed(runs))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not pending:
                    return
                run = pending.pop()
            try:
                run.newest  # noqa: B018 - lists and caches the run's checkpoints
            except Exception:  # noqa: BLE001 - recorded as the run's error
                pass
            done[id(run)] = True

    threads = [threading.Thread(target=work, daemon=True, name="keepalive-list")
               for _ in range(min(workers, len(runs)))]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return [r for r in runs if done.get(id(r))], [r for r in runs if not done.get(id(r))]


# ------------------------------------------------------------------------------------ uploads
def pending_summary(spool_root: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """What waits in this machine's spool: ``{count, bytes, oldest_age_seconds, destinations:
    [{destination, spool, count, bytes, oldest_age_seconds, newest_step}]}``, or None when nothing
    does (``keepalive status``'s ``pending_uploads``)."""
    now = time.time()
    rows = []
    for run in spooled_runs(spool_root=spool_root):
        pending = run.pending_uploads()
        if not pending:
            continue
        oldest = min((c.created for c in pending if c.created), default=None)
        rows.append({"destination": run.url, "spool": run.spool.folder if run.spool else None,
                     "count": len(pending), "bytes": sum(c.size_bytes or 0 for c in pending),
                     "oldest_age_seconds": None if oldest is None else max(0.0, now - oldest),
                     "newest_step": pending[0].step})
    if not rows:
        return None
    ages = [r["oldest_age_seconds"] for r in rows if r["oldest_age_seconds"] is not None]
    return {"count": sum(r["count"] for r in rows), "bytes": sum(r["bytes"] for r in rows),
            "oldest_age_seconds": max(ages) if ages else None, "destinations": rows}


def format_pending(pending: Optional[Mapping[str, Any]], size: Callable[[float], str] = format_bytes) -> str:
    """One line for :func:`pending_summary`'s result (``keepalive status``); ``size`` writes the bytes
    pending (the status panel passes one that gives both units)."""
    if not pending:
        return "none pending"
    if "count" not in pending:
        return f"unknown ({pending.get('error')})"
    text = (f"{pending['count']} checkpoint(s), {size(pending['bytes'])} pending, oldest "
            f"{format_duration(pending.get('oldest_age_seconds'))} old")
    dests = ", ".join(r["destination"] for r in pending.get("destinations") or [])
    return f"{text} (to {dests}; `keepalive sync` uploads them)" if dests else text


def resuming_line(run: str, info: Any, counters: Mapping[str, int], previous: Optional[Mapping[str, Any]],
                  describe: Optional[Callable[[], str]] = None) -> str:
    """The one line said when a run resumes: from which checkpoint, where it lies (the destination or
    this machine's spool: :func:`read_from`), how old, what is redone, and the adapter's own words
    (``describe()``, e.g. what is restored; never fatal)."""
    detail = ""
    try:
        detail = (describe() or "") if describe is not None else ""
    except Exception as exc:  # noqa: BLE001 - words only: never stop a resume for them
        log.debug("describe() failed: %s", exc)
    age = time.time() - (info.created or time.time())
    step = counters.get("step", 0)
    redone = ""
    if previous and previous.get("step") is not None and previous["step"] > step:
        # the last writer's lease notes its counters at each heartbeat (every 30 s or so): it got at
        # least that far, likely further; those steps are trained again
        redone = f"; the last session got to step {previous['step']} or further: the steps after {step} are redone"
    finished = " (this run had finished)" if (info.manifest or {}).get("metadata", {}).get("finished") else ""
    return (f"resuming run '{run}' from {info.name}: {position(counters)}, saved "
            f"{format_duration(age)} ago{read_from(info)}{redone}{finished}{'; ' + detail if detail else ''}")


def read_from(info: Any) -> str:
    """Where the copy a resume read lies, as the resume line says it: ``, from the destination URL``,
    ``, from this machine's spool FOLDER (not uploaded yet)``, or ``, from this machine's copy in
    FOLDER (uploaded already)``; "" when the copy does not say (a checkpoint described by hand)."""
    source, url = getattr(info, "source", None), getattr(info, "url", None)
    if source not in ("spool", "destination") or not isinstance(url, str) or "/" not in url:
        return ""
    folder = url.rsplit("/", 1)[0]
    if source == "destination":
        return f", from the destination {folder}"
    if getattr(info, "cached", False):
        return f", from this machine's copy in {folder} (uploaded already)"
    return f", from this machine's spool {folder} (not uploaded yet)"


def position(counters: Mapping[str, int], batches: Optional[int] = None) -> str:
    """Where a checkpoint lies, with epochs numbered as ``for epoch in ckpt.epochs(n)`` numbers them
    (from 0: "epoch 1" is the pass in which the loop variable was 1) and batches counted (how many of
    the epoch's batches were done). ``batches``: the epoch's length when known, 0 for a loader without
    one (a stream). At an epoch end ``at the end of epoch 1, step 80`` (the loop goes on with epoch 2).

    >>> position({"epoch": 1, "batch": 40, "step": 80}), position({"epoch": 2, "batch": 0, "step": 80})
    ('in epoch 1 after 40 batches, step 80', 'at the end of epoch 1, step 80')
    >>> position({"epoch": 0, "batch": 30, "step": 30}, batches=0)
    'in epoch 0 after 30 batches of an unsized loader, step 30'
    """
    epoch, batch, step = (int(counters.get(k, 0) or 0) for k in ("epoch", "batch", "step"))
    if batch:
        of = f" of {batches}" if batches else ""
        unsized = " of an unsized loader" if batches == 0 else ""
        return f"in epoch {epoch} after {batch}{of} batches{unsized}, step {step}"
    if epoch:
        return f"at the end of epoch {epoch - 1}, step {step}"
    return f"at the start of epoch 0, step {step}"
