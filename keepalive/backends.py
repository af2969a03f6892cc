"""The few storage operations the store needs, for a local path and for any fsspec URL.

Like fsspec itself this is a small interface with several backends. Only operations every backend
implements reliably are used: create a folder, write a whole file as a stream, read a file (or a
byte range), list a folder, delete a tree. No rename, symlink or hard link: Google Drive's FUSE mount
and object stores break on them (gcp-storage-emulator answers rename with 501; gcsfs then retries for
~33 s before copy + delete).
"""
from __future__ import annotations

import errno
import io
import os
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator, List, Mapping, Optional


@dataclass
class Entry:
    name: str
    is_dir: bool
    size: Optional[int] = None


class Backend:
    """A storage location; paths are backend-native strings joined with ``/``."""

    #: whether :meth:`open_write` files can be fsync'ed (local disks and FUSE mounts like Drive)
    local: bool = False
    #: the size of the pieces a large file is handed to :meth:`open_write`'s file in (the store
    #: hashes each piece right after writing it)
    write_piece: int = 64 << 20

    def join(self, *parts: str) -> str:
        return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p)

    def url(self, path: str) -> str:
        raise NotImplementedError

    def makedirs(self, path: str) -> None:
        raise NotImplementedError

    def open_write(self, path: str) -> BinaryIO:
        raise NotImplementedError

    def sync(self, fileobj: BinaryIO) -> None:
        """Make the bytes written to ``fileobj`` durable where the backend can (fsync)."""

    def sync_dir(self, path: str) -> None:
        """Make a folder's entries durable where the backend can."""

    def open_read(self, path: str) -> BinaryIO:
        raise NotImplementedError

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open_write(path) as f:
            f.write(data)
            self.sync(f)

    def listdir(self, path: str) -> List[Entry]:
        """Entries of a folder; a missing folder raises ``FileNotFoundError``."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def remove_tree(self, path: str) -> None:
        raise NotImplementedError

    def remove_file(self, path: str) -> None:
        raise NotImplementedError

    def mmap(self, path: str):
        """A read-only memory map of a local file, or ``None`` where the backend has none."""
        return None


class LocalBackend(Backend):
    local = True
    # measured here (benchmarks/store_throughput.py, 512 MiB): through the page cache 16-32 MiB
    # pieces beat 4 MiB ones by ~20 % (each piece starts its own writeback); direct writes gain up to
    # 64 MiB (more of the disk's queue in flight). The hash after each piece costs the same for any
    # size (xxh3 runs at memory speed, ~30 GB/s: whether the piece is still cached does not show).
    write_piece = 32 << 20

    def url(self, path: str) -> str:
        return path

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def open_write(self, path: str) -> BinaryIO:
        # unbuffered: the store hands over large pieces; a Python-level buffer would only copy them.
        # No O_DIRECT on FUSE (Drive) or network file systems: there it is allowed but sends every
        # write synchronously through the daemon or the network, uncached, in small requests.
        return WritebackFile(path, direct=maps_safely(path))

    def sync(self, fileobj: BinaryIO) -> None:
        fileobj.flush()
        os.fsync(fileobj.fileno())

    def sync_dir(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:  # some FUSE mounts (Drive) refuse fsync on folders; the files are synced
            pass
        finally:
            os.close(fd)

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")

    def listdir(self, path: str) -> List[Entry]:
        out = []
        with os.scandir(path) as it:
            for e in it:
                try:
                    is_dir = e.is_dir()
                    size = None if is_dir else e.stat().st_size
                except FileNotFoundError:
                    continue
                out.append(Entry(e.name, is_dir, size))
        return out

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=False) if os.path.isdir(path) else self.remove_file(path)

    def remove_file(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def mmap(self, path: str):
        import mmap

        if not maps_safely(path):
            return None  # read into private memory instead (see maps_safely)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return None
            # ACCESS_COPY: private and writable (copy-on-write), so tensors can be viewed on it
            # without a copy and without ever writing back to the checkpoint. (MAP_POPULATE would
            # break copy-on-write for every page of a writable private map: measured 30x slower.)
            m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            if hasattr(m, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
                m.madvise(mmap.MADV_WILLNEED)
            return m


#: how many bytes a local write lets pile up in the page cache before it starts writing them to disk
WRITEBACK_EVERY = 32 << 20

_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


def _find_sync_file_range() -> Optional[Callable[..., int]]:
    """libc's ``sync_file_range`` (Linux only; Python has no wrapper), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn: Any = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # a ctypes call releases the GIL while it runs


_sync_file_range = _find_sync_file_range()


#: O_DIRECT needs a write's file offset, memory address and length aligned to the device's logical
#: block (512 B or 4 KiB); a page covers both, and keeps direct and cached writes on separate pages
DIRECT_ALIGN = 4096
#: shorter writes go through the page cache (a direct write waits for the disk; small ones are cheap)
DIRECT_MIN = 1 << 20
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def _address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class WritebackFile(io.FileIO):
    """A local file opened for writing that sends large aligned buffers straight to the disk and
    starts writing everything else while more arrives.

    * A write whose file offset, memory address and length are page-aligned (a snapshot buffer
      after a page-aligned header) goes with ``O_DIRECT``: the disk reads it from the caller's
      memory, with no copy into the page cache, no page-cache allocation and no kernel writeback
      afterwards, which is most of a write's CPU cost. Where the file system refuses it (tmpfs on
      old kernels, FUSE mounts such as Drive) the file silently writes through the page cache.
    * Bytes written through the page cache would otherwise stay dirty until the final fsync (or
      until 10 % of the memory is dirty): the disk idles while write() fills the cache and the CPU
      idles while fsync drains it. Starting the writeback of every ``WRITEBACK_EVERY`` bytes
      overlaps the two.

    The fsync stays the durability point. ``write`` always writes all it is given. Measured here
    (``benchmarks/store_throughput.py``, 256 MiB-1 GiB, 2 busy cores): a store commit through the
    page cache 0.72-1.29x a raw write() + fsync of the same bytes at 0.25-0.35 CPU s/GiB; with
    O_DIRECT 1.18-2.22x at 0.05-0.06 CPU s/GiB (the raw write: 0.20-0.29).
    """

    def __init__(self, path: str, direct: bool = True):
        super().__init__(path, "wb")
        self._position = 0
        self._unsent_from: Optional[int] = None  # first cached byte whose writeback is not started
        self._start_writeback = _sync_file_range
        self._direct_allowed = direct and bool(_O_DIRECT)
        self._direct_on = False
        #: bytes written with O_DIRECT (for tests and benchmarks)
        self.direct_bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while len(view):
            direct = self._direct_length(view)
            if direct and self._set_direct(True):
                try:
                    n = super().write(view[:direct]) or 0
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._direct_allowed = False  # refused for this file: the page cache it is
                    continue
                self.direct_bytes += n
            else:
                self._set_direct(False)
                n = super().write(view) or 0
                self._sent_to_cache(n)
            if n <= 0:
                raise OSError(errno.EIO, "write() wrote nothing")
            self._position += n
            view = view[n:]
        return total

    def _direct_length(self, view: memoryview) -> int:
        """How many leading bytes of ``view`` may go with O_DIRECT (0: none)."""
        if not self._direct_allowed or len(view) < DIRECT_MIN or self._position % DIRECT_ALIGN:
            return 0
        if _address(view) % DIRECT_ALIGN:
            return 0
        return len(view) - len(view) % DIRECT_ALIGN

    def _set_direct(self, on: bool) -> bool:
        if on == self._direct_on:
            return True
        import fcntl

        flags = fcntl.fcntl(self.fileno(), fcntl.F_GETFL)
        try:
            fcntl.fcntl(self.fileno(), fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
        except OSError:
            if not on:
                raise
            self._direct_allowed = False  # the file system has no direct I/O
            return False
        self._direct_on = on
        return True

    def _sent_to_cache(self, n: int) -> None:
        if self._unsent_from is None:
            self._unsent_from = self._position
        unsent = self._position + n - self._unsent_from
        if self._start_writeback is not None and unsent >= WRITEBACK_EVERY:
            if self._start_writeback(self.fileno(), self._unsent_from, unsent, _SYNC_FILE_RANGE_WRITE) != 0:
                self._start_writeback = None  # refused here (ESPIPE, EINVAL on some mounts): fsync does it
            self._unsent_from = None


#: file systems where a mapped file can vanish under a running training: a FUSE daemon that dies
#: (Google Drive's "Transport endpoint is not connected") or a network share turns the next page
#: fault into SIGBUS, a crash of the training keepalive exists to protect
_UNSAFE_TO_MAP = ("fuse", "nfs", "cifs", "smb", "9p", "sshfs", "davfs", "afs", "ceph", "glusterfs", "lustre")


#: the mount table read (a test feeds a fixture of /proc/mounts' format instead)
MOUNTS_FILE = "/proc/self/mounts"
#: FUSE file systems that are this machine's own storage, not a daemon's window on a remote one: a
#: rootless container's root (fuse-overlayfs), lxcfs, the desktop's document portal, snaps
_LOCAL_FUSE = ("fuse.fuse-overlayfs", "fuse.lxcfs", "fuse.portal", "fuse.snapfuse", "fuse.squashfuse")


def _unescape(field: str) -> str:
    """A mount table's field: the kernel writes a space, tab, newline or backslash as ``\\ooo``."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts() -> List[tuple]:
    """(mount point, file system type) of every mount, longest mount point first."""
    out = []
    try:
        with open(MOUNTS_FILE, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    out.append((_unescape(parts[1]), parts[2]))
    except OSError:
        return []
    return sorted(out, key=lambda m: len(m[0]), reverse=True)


def _mount_of(path: str) -> Optional[tuple]:
    """(mount point, file system type) of the mount holding ``path``, or None."""
    real = os.path.realpath(path)
    for point, kind in _mounts():
        if real == point or real.startswith(point.rstrip("/") + "/"):
            return point, kind
    return None


def filesystem_type(path: str) -> Optional[str]:
    """The type of the file system holding ``path`` (``ext4``, ``fuse.drive``, ...), or None."""
    mount = _mount_of(path)
    return mount[1] if mount else None


def fuse_mount_of(path: str) -> Optional[str]:
    """The mount point of the FUSE mount holding ``path`` (from the mount table), or None: Google
    Drive on Colab wherever it is mounted (``/content/drive``, old tutorials' ``/content/gdrive``),
    rclone, gcsfuse, s3fs-fuse, sshfs. A daemon serves those from a remote store: a write may stall,
    and the mount may vanish (``Transport endpoint is not connected``). Not the FUSE file systems
    that are local storage (:data:`_LOCAL_FUSE`), nor a root file system served through FUSE."""
    mount = _mount_of(path)
    if mount is None:
        return None
    point, kind = mount
    kind = kind.lower()
    if not (kind == "fuse" or kind.startswith("fuse.")) or kind in _LOCAL_FUSE or point == "/":
        return None
    return point


def maps_safely(path: str) -> bool:
    """Whether tensors may stay views on a memory map of ``path`` after a resume: only on a local
    disk. On FUSE (Google Drive's mount) or network file systems the file is read into memory."""
    if os.path.realpath(path).startswith("/content/drive/"):
        return False
    kind = (filesystem_type(path) or "").lower()
    return not any(kind.startswith(u) or kind.startswith("fuse." + u) for u in _UNSAFE_TO_MAP)


class FsspecBackend(Backend):
    def __init__(self, fs, protocol: str):
        self.fs = fs
        self.protocol = protocol

    def url(self, path: str) -> str:
        return path if "://" in path else f"{self.protocol}://{path}"

    def makedirs(self, path: str) -> None:
        try:
            self.fs.makedirs(path, exist_ok=True)
        except FileExistsError:
            pass

    def open_write(self, path: str) -> BinaryIO:
        return self.fs.open(path, "wb")

    def open_read(self, path: str) -> BinaryIO:
        return self.fs.open(path, "rb")

    def read_bytes(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def write_bytes(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def _fresh(self, path: str) -> None:
        # s3fs / gcsfs cache listings; the store must see what other processes committed.
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # pragma: no cover - backends without a cache
            pass

    def listdir(self, path: str) -> List[Entry]:
        self._fresh(path)
        try:
            items = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            raise
        if not items and not self.fs.exists(path):
            raise FileNotFoundError(errno.ENOENT, "no such folder", self.url(path))
        out = []
        base = path.rstrip("/")
        for item in items:
            name = item["name"].rstrip("/")
            if name == base or name == base.split("://")[-1]:
                continue
            out.append(Entry(name.rsplit("/", 1)[-1], item.get("type") == "directory", item.get("size")))
        return out

    def exists(self, path: str) -> bool:
        self._fresh(path)
        return self.fs.exists(path)

    def remove_tree(self, path: str) -> None:
        self._fresh(path)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self._fresh(path)

    def remove_file(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass


def local_path(url: str) -> Optional[str]:
    """The absolute local path ``url`` names (a plain path or ``file://``), None for another protocol."""
    url = os.fspath(url)
    if "://" in url and not url.startswith("file://"):
        return None
    path = url[len("file://"):] if url.startswith("file://") else url
    return os.path.abspath(os.path.expanduser(path))


#: what tells gcsfs where to find Google Cloud credentials, or another server than Google's
_GOOGLE_ENV = ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "GCE_METADATA_HOST",
               "GCE_METADATA_IP", "GCE_METADATA_ROOT")


def _on_google_cloud() -> bool:
    """Whether this machine is a Google Compute Engine VM (Colab and Kaggle are): its metadata
    server may hand out credentials, so only gcsfs can tell."""
    for name in ("product_name", "bios_vendor", "sys_vendor"):
        try:
            with open(f"/sys/class/dmi/id/{name}", encoding="utf-8", errors="replace") as f:
                if "google" in f.read().lower():
                    return True
        except OSError:
            continue
    return False


def missing_google_credentials(storage_options: Optional[dict] = None,
                               env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why gcsfs would find no credentials for a ``gs://`` URL (what was looked for), or None when
    it may find some (a token or endpoint given, a credentials file, a metadata server, an emulator).

    Without this check gcsfs falls back to anonymous access after probing for a metadata server,
    and the first request then waits for its connect timeout on a machine without network: the user
    hears "no answer" after 15 s instead of "no credentials" at once."""
    environ = os.environ if env is None else env
    options = storage_options or {}
    if any(k in options for k in ("token", "endpoint_url", "credentials")):
        return None
    if any(environ.get(k) for k in _GOOGLE_ENV):
        return None
    if any(k.startswith(("FSSPEC_GCS", "FSSPEC_GS")) for k in environ):
        return None  # fsspec's own configuration passes options from the environment
    try:
        import fsspec.config

        if any((fsspec.config.conf.get(p) or {}).get("token") for p in ("gcs", "gs")):
            return None
    except Exception:  # noqa: BLE001 - no fsspec configuration to read
        pass
    config = environ.get("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
    candidates = [os.path.join(config, "application_default_credentials.json"),
                  os.path.join(os.path.expanduser("~"), ".gcs_tokens")]  # gcsfs's own token cache
    if any(os.path.exists(c) for c in candidates):
        return None
    if _on_google_cloud():
        return None
    return (f"no GOOGLE_APPLICATION_CREDENTIALS, no {candidates[0]}, no token in storage_options, "
            "not a Google Cloud VM")


#: storage options that give s3fs its credentials, or say that none are needed
_AWS_OPTIONS = ("key", "secret", "token", "username", "password", "anon", "session")


def missing_aws_credentials(storage_options: Optional[dict] = None,
                            session_options: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """Why s3fs would find no credentials for an ``s3://`` URL (what was looked for), or None when it
    may find some: given in ``storage_options`` or fsspec's configuration, or found by botocore's
    own search (the environment, ``AWS_PROFILE``, ``~/.aws``, an EC2 instance's role), the one s3fs
    makes. ``session_options``: what s3fs passes to its botocore session (its filesystem's
    ``kwargs``: ``profile``, or an option it does not know, which raises ``TypeError`` here as there).

    Without this check a store without credentials fails at its first request: at the first
    ``ckpt.epochs()``, with botocore's ``NoCredentialsError`` at the end of thirty frames."""
    options = storage_options or {}
    client = options.get("client_kwargs") or {}
    if any(options.get(k) for k in _AWS_OPTIONS) or client.get("aws_access_key_id"):
        return None
    if any(k.startswith("FSSPEC_S3") for k in os.environ):
        return None  # fsspec's own configuration passes options from the environment
    try:
        import fsspec.config

        if any((fsspec.config.conf.get("s3") or {}).get(k) for k in _AWS_OPTIONS):
            return None
    except Exception:  # noqa: BLE001 - no fsspec configuration to read
        pass
    try:
        import botocore.exceptions
        import botocore.session
    except ImportError:
        return None  # no s3fs: its import error says so
    session = botocore.session.Session(**(session_options or {}))  # TypeError: an unknown option
    try:
        if session.get_credentials() is not None:
            return None
    except botocore.exceptions.ProfileNotFound as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - a configuration botocore cannot read: s3fs will say more
        return None
    return ("no AWS_ACCESS_KEY_ID, no AWS_PROFILE, no ~/.aws/credentials, no key in storage_options, "
            "not an EC2 instance with a role")


def _forget_s3_filesystems() -> None:
    """Drop s3fs's cached filesystems: one built while no credentials were set keeps its client
    without them, and fsspec would hand it out again (same arguments) after the user set them."""
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None:
        s3fs.S3FileSystem.clear_instance_cache()


def _check_credentials(url: str, storage_options: Optional[dict], fs: Any = None) -> None:
    """Raise one clear :class:`~keepalive.errors.StorageError` for a cloud URL without credentials,
    at construction rather than at the first request. Asked before the filesystem is built for
    ``gs://`` (gcsfs probes for a metadata server when it is built) and after it for ``s3://``
    (s3fs first says which of the options it does not take)."""
    from .errors import StorageError

    protocol = url.split("://", 1)[0]
    if protocol in ("gs", "gcs"):
        missing = missing_google_credentials(storage_options)
        if missing:
            raise StorageError(f"no Google Cloud credentials for {url} ({missing}): on "
                               "Colab run google.colab.auth.authenticate_user(); elsewhere set "
                               "GOOGLE_APPLICATION_CREDENTIALS=/path/key.json or run `gcloud auth "
                               "application-default login`, or pass storage_options={'token': "
                               "'/path/key.json'} ({'token': 'anon'} for a public bucket)")
    elif protocol in ("s3", "s3a"):
        missing = missing_aws_credentials(storage_options, getattr(fs, "kwargs", None))
        if missing:
            _forget_s3_filesystems()
            raise StorageError(f"no AWS credentials for {url} (Unable to locate credentials: {missing}): set "
                               "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and run this "
                               "again, or pass storage_options={'key': '...', 'secret': '...'} "
                               "({'anon': True} for a public bucket)")


def backend_for(url: str, storage_options: Optional[dict] = None) -> "tuple[Backend, str]":
    """The backend for ``url`` and the backend-native path of it."""
    url = os.fspath(url)
    path = local_path(url)
    if path is not None:
        return LocalBackend(), path
    import fsspec.core

    protocol = url.split("://", 1)[0]
    if protocol in ("gs", "gcs"):
        _check_credentials(url, storage_options)
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if protocol not in ("gs", "gcs"):
        _check_credentials(url, storage_options, fs)
    if protocol == "memory" and not path.startswith("/"):
        path = "/" + path
    return FsspecBackend(fs, protocol), path.rstrip("/")


def read_chunks(f: BinaryIO, chunk: int = 16 << 20) -> Iterator[bytes]:
    while True:
        block = f.read(chunk)
        if not block:
            return
        yield block


__all__ = ["Backend", "LocalBackend", "FsspecBackend", "Entry", "backend_for", "local_path", "read_chunks",
           "missing_google_credentials", "missing_aws_credentials", "fuse_mount_of", "filesystem_type",
           "maps_safely"]
