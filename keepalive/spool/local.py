"""The spool on this machine's disk: one :class:`Spool` (a checkpoint store) per destination run, and
the ``SPOOL.json`` record that names the destination, so any process can find and upload it.

Layout: ``$KEEPALIVE_SPOOL/<run>-<12 hex of sha1(destination URL)>/`` holds ``SPOOL.json`` and the
run folder ``<run>/ckpt-...``. A spooled checkpoint uploaded already carries ``UPLOADED.json``; the
newest such one stays as the local cache of the run.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from .. import settings
from .._version import __version__
from ..store import MANIFEST, Buffer, CheckpointInfo, CheckpointStore, is_at_or_below

SPOOL_RECORD = "SPOOL.json"
UPLOADED = "UPLOADED.json"  # in a spooled checkpoint's folder: it verified at the destination
_SECRET = re.compile(r"secret|token|password|passwd|credential|key|auth", re.I)

__all__ = ["Spool", "SPOOL_RECORD", "UPLOADED", "spool_root", "spool_dir_for", "public_options",
           "read_record", "list_spools"]


def spool_root(root: Optional[str] = None) -> str:
    """The spool's root folder: ``root``, else ``$KEEPALIVE_SPOOL`` (default ``/tmp/keepalive-spool``)."""
    return os.path.abspath(os.path.expanduser(root or settings.get("KEEPALIVE_SPOOL")))


def spool_dir_for(dest_url: str, run: str, root: Optional[str] = None) -> str:
    """``<root>/<run>-<12 hex of sha1(destination URL)>``: one spool per destination run."""
    digest = hashlib.sha1(dest_url.encode()).hexdigest()[:12]
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", run)[:40] or "run"
    return os.path.join(spool_root(root), f"{safe}-{digest}")


def public_options(options: Any) -> Any:
    """Storage options without anything that looks like a secret (``SPOOL.json`` is a plain file)."""
    if isinstance(options, Mapping):
        return {k: public_options(v) for k, v in options.items() if not _SECRET.search(str(k))}
    if isinstance(options, (list, tuple)):
        return [public_options(v) for v in options]
    return options if isinstance(options, (str, int, float, bool, type(None))) else str(options)


class Spool(CheckpointStore):
    """The local spool of one destination run (a checkpoint store on the VM's disk).

    Its ``seq_floor`` is raised to the newest ``seq`` known at the destination, so spooled manifests
    continue the destination's numbering (``keep_every`` counts on it) even when the spool starts
    empty. Every checkpoint it lists has ``source="spool"``; an uploaded copy kept as the local cache
    has ``cached=True``.
    """

    def __init__(self, folder: str, destination: str, run: str):
        self.folder = folder
        self.destination = destination
        super().__init__(os.path.join(folder, run), keep=None)

    @classmethod
    def for_destination(cls, dest: CheckpointStore, root: Optional[str] = None) -> "Spool":
        """The spool of the destination run ``dest`` (whether or not it exists on disk yet)."""
        return cls(spool_dir_for(dest.url, dest.run, root), dest.url, dest.run)

    @classmethod
    def from_record(cls, folder: str, record: Mapping[str, Any]) -> "Spool":
        """The spool in ``folder``, described by its ``SPOOL.json`` record."""
        return cls(folder, record["destination"], record.get("run") or "run")

    def write_record(self, dest: CheckpointStore, storage_options: Optional[dict]) -> None:
        """``SPOOL.json``: which destination these checkpoints are for (for ``keepalive sync``)."""
        os.makedirs(self.path, exist_ok=True)
        record = {"destination": dest.url, "run": dest.run, "keep": dest.keep,
                  "keep_every": dest.keep_every, "storage_options": public_options(storage_options or {}),
                  "host": socket.gethostname(), "pid": os.getpid(), "updated": time.time(),
                  "keepalive": __version__}
        tmp = os.path.join(self.folder, f".{SPOOL_RECORD}.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, os.path.join(self.folder, SPOOL_RECORD))  # the spool is local disk: rename is fine

    def _write_one(self, path: str, chunks: Iterable[Buffer], hasher: Any = None,
                   progress: Optional[Callable[[int], None]] = None) -> int:
        """As the store's, except that a manifest appears whole or not at all. The uploader lists the
        spool from its own thread (``keepalive sync`` from another process) while a commit writes
        here; a manifest it read half-written would look like a damaged checkpoint, and it removes
        damaged ones. The spool is local disk, where a rename is atomic (a destination needs none)."""
        if os.path.basename(path) != MANIFEST:
            return super()._write_one(path, chunks, hasher, progress)
        partial = os.path.join(os.path.dirname(path), f".{MANIFEST}.partial")
        n = super()._write_one(partial, chunks, hasher, progress)
        os.replace(partial, path)  # the store syncs the folder next, which makes the rename durable
        return n

    def list(self, include_uncommitted: bool = False) -> List[CheckpointInfo]:
        """As :meth:`CheckpointStore.list`, each marked ``source="spool"``; an uploaded copy kept as
        the local cache is ``cached`` (a resume uses it only where the destination has it too, or
        cannot be read: a run deleted at the destination on purpose does not come back from here)."""
        out = super().list(include_uncommitted)
        for info in out:
            info.source = "spool"
            info.cached = os.path.exists(os.path.join(info.path, UPLOADED))
        return out

    def pending(self) -> List[CheckpointInfo]:
        """Committed spooled checkpoints not yet uploaded, oldest first."""
        return [c for c in self.list() if not c.cached]

    def cached(self) -> List[CheckpointInfo]:
        """Uploaded checkpoints kept as the local cache (normally the newest one only)."""
        return [c for c in self.list() if c.cached]

    def mark_uploaded(self, info: CheckpointInfo) -> None:
        """Record that ``info`` verified at the destination (it becomes a cached copy)."""
        with open(os.path.join(info.path, UPLOADED), "w") as f:
            f.write(json.dumps({"uploaded": time.time(), "to": self.destination}))
        info.cached = True

    def has_pending(self) -> bool:
        return os.path.isdir(self.path) and bool(self.pending())


def read_record(folder: str) -> Optional[Dict[str, Any]]:
    """The ``SPOOL.json`` record of a spool folder, or None (absent, unreadable, not a record)."""
    try:
        with open(os.path.join(folder, SPOOL_RECORD)) as f:
            record = json.load(f)
        return record if isinstance(record, dict) and "destination" in record else None
    except (OSError, ValueError):
        return None


def list_spools(root: Optional[str] = None, below: Optional[str] = None) -> List[Tuple[str, Dict[str, Any]]]:
    """``(folder, SPOOL.json record)`` of every spool under the spool root (``root``), or only of
    those whose destination is the run or folder ``below`` (a path or URL) or lies below it."""
    base = spool_root(root)
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for name in names:
        folder = os.path.join(base, name)
        record = read_record(folder)
        if record is None or not isinstance(record.get("destination"), str):
            continue
        if below is not None and not is_at_or_below(record["destination"], below):
            continue
        out.append((folder, record))
    return out
