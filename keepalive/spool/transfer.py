"""One spooled checkpoint copied to its destination: data files first, ``MANIFEST.json`` last.

What landed is verified before the next file: on local and mounted destinations every byte is read
back and hashed, on object stores every size is read back (a fresh listing: s3fs and gcsfs cache
them); the manifest is always read back whole. A file that is already there and verifies is not
copied again, so an upload cut short by an outage goes on where it stopped. Nothing here retries or
reports: a fault is raised to :class:`~keepalive.spool.uploader.Uploader`, whose loop retries the
whole checkpoint with backoff.
"""
from __future__ import annotations

import errno
import os
import sys
from typing import Any, Callable, Mapping, Optional

from .. import settings
from ..backends import Backend, FsspecBackend
from ..errors import StorageError
from ..store import MANIFEST, CheckpointInfo, CheckpointStore, new_hasher
from ..units import format_bytes

__all__ = ["CheckpointCopy", "SourceGone", "COPY_CHUNK"]

#: bytes read and written at a time (copying, hashing)
COPY_CHUNK = 8 << 20


class SourceGone(Exception):
    """The spooled copy vanished while it was being uploaded (dropped by the size bound)."""


class _NullBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class CheckpointCopy:
    """Copies the spooled checkpoint ``c`` (read through ``source``) into ``dest``, verified.

    ``progress(n)`` is told of every block written (``keepalive sync``'s bar); ``stopped()`` is asked
    after each block, and a stopped uploader ends the copy with ``ECANCELED``. ``bars``: a tqdm bar
    for a checkpoint large enough (``KEEPALIVE_PROGRESS``, ``KEEPALIVE_PROGRESS_MIN_BYTES``).
    """

    def __init__(self, c: CheckpointInfo, source: Backend, dest: CheckpointStore, *, bars: bool,
                 progress: Optional[Callable[[int], None]], stopped: Callable[[], bool]):
        self.c = c
        self.source = source
        self.dest = dest
        self.bars = bars
        self.progress = progress
        self.stopped = stopped

    def run(self) -> None:
        """Copy and verify every file, the manifest last (the lease checked to be this session's before
        the first file and again before the manifest); raises :class:`SourceGone`,
        :class:`StorageError` or the backend's error."""
        c, b = self.c, self.dest.backend
        folder = b.join(self.dest.path, c.name)
        manifest = c.manifest or {}
        algorithm = manifest.get("checksum_algorithm", "xxh3_64")
        try:
            raw = self.source.read_bytes(os.path.join(c.path, MANIFEST))
        except FileNotFoundError:
            raise SourceGone(c.name) from None
        # LeaseLostError before the first byte too: a session whose run was taken over must not begin
        # a folder there again after the new holder removed its torn ones
        self.dest.lease.check()
        bar = self._bar(c.size_bytes or 0)
        try:
            b.makedirs(folder)
            for entry in manifest["files"]:
                dst = b.join(folder, entry["name"])
                if not self._landed(dst, entry, algorithm):
                    self._copy(os.path.join(c.path, entry["name"]), dst, bar)
                    if not self._landed(dst, entry, algorithm):
                        raise StorageError(errno.EIO, f"{b.url(dst)} does not match what "
                                                      "was written (size or checksum): retrying")
                else:
                    bar.update(entry["size"])
            self.dest.lease.check()  # LeaseLostError: another session owns the run now
            self._write_manifest(folder, raw)
        finally:
            bar.close()

    def _write_manifest(self, folder: str, raw: bytes) -> None:
        b = self.dest.backend
        mpath = b.join(folder, MANIFEST)
        if not self._same_bytes(mpath, raw):
            b.write_bytes(mpath, raw)
            if b.local:
                b.sync_dir(folder)
            if not self._same_bytes(mpath, raw):
                raise StorageError(errno.EIO, f"the manifest read back from {b.url(mpath)} differs")

    def _bar(self, total: int) -> Any:
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
                        desc=f"keepalive: uploading step {self.c.step} ({format_bytes(total)}) to {target}",
                        file=sys.stderr, mininterval=0.5)
        except Exception:  # noqa: BLE001 - no tqdm / no display: no bar
            return _NullBar()

    def _copy(self, src: str, dst: str, bar: Any) -> None:
        b = self.dest.backend
        try:
            f = open(src, "rb", buffering=0)
        except FileNotFoundError:
            raise SourceGone(src) from None
        with f, b.open_write(dst) as out:
            while True:
                block = f.read(COPY_CHUNK)
                if not block:
                    break
                out.write(block)
                bar.update(len(block))
                if self.progress is not None:
                    self.progress(len(block))
                if self.stopped():
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
