"""Where a local destination lives: mounts that vanish, Google Drive on Colab, and how storage
errors are worded for the user.

Without :class:`MountWatch`, a write into a vanished mount (Drive's FUSE daemon gone, a folder
unmounted) would silently create the folders again on the VM's own disk. Any FUSE mount in the mount
table (Drive wherever a tutorial mounted it, rclone, gcsfuse: :func:`keepalive.backends.fuse_mount_of`)
is treated as Drive is: written through the spool, and watched.
"""
from __future__ import annotations

import errno
import os
import sys
from typing import Optional

from ..backends import filesystem_type, fuse_mount_of
from ..errors import StorageError

DRIVE_ROOT = "/content/drive"
REMOUNT_HINT = "from google.colab import drive; drive.mount('/content/drive', force_remount=True)"

#: the file system type of Google Drive's FUSE mount on Colab, wherever it is mounted
DRIVE_FUSE_TYPE = "fuse.drive"

__all__ = ["MountVanished", "MountWatch", "DRIVE_ROOT", "DRIVE_FUSE_TYPE", "REMOUNT_HINT", "is_drive_path",
           "is_mount", "on_colab", "is_mount_error", "describe_error", "flush_and_unmount_drive"]


def is_mount(path: str) -> bool:
    """Whether ``path`` is a mount point."""
    return os.path.ismount(path)


def _under(path: str, root: str) -> bool:
    return os.path.abspath(path).startswith(root.rstrip("/") + "/")


def is_drive_path(path: str) -> bool:
    """Whether a local path lies on Colab's Google Drive mount: under ``/content/drive``, or on a
    FUSE mount of Drive's type wherever it is (old tutorials mount it at ``/content/gdrive``)."""
    if _under(path, DRIVE_ROOT):
        return True
    return fuse_mount_of(path) is not None and (filesystem_type(path) or "").lower() == DRIVE_FUSE_TYPE


def on_colab() -> bool:
    """Whether this process runs on a Colab VM (its module is loaded, or its release tag is set)."""
    return "google.colab" in sys.modules or bool(os.environ.get("COLAB_RELEASE_TAG"))


def flush_and_unmount_drive() -> None:
    """Colab's ``drive.flush_and_unmount()``: every byte reaches Drive, and Drive is unmounted."""
    from google.colab import drive  # the one Colab-only module used here

    drive.flush_and_unmount()


def describe_error(exc: BaseException) -> str:
    """An error as one short phrase for the user: ``EIO: ...`` or ``TimeoutError: ...``."""
    name = errno.errorcode.get(getattr(exc, "errno", None) or -1)
    text = str(exc) or type(exc).__name__
    return f"{name}: {text}" if name and name not in text else f"{type(exc).__name__}: {text}"


class MountVanished(StorageError):
    """The destination's folder or mount is gone (unmounted, FUSE daemon dead, folder deleted)."""

    def __init__(self, path: str, reason: str, code: int = errno.ENOTCONN):
        super().__init__(code, f"{path} is not reachable: {reason}")
        self.path = path
        self.reason = reason


class MountWatch:
    """Checks that a local destination is still where it was: its nearest existing ancestor at the
    start (the run folder's parent when it exists) still exists, on the same device; for a path on
    the Drive mount, that ``/content/drive`` is still a mount point; for one on another FUSE mount,
    that its mount point is still in the mount table."""

    def __init__(self, path: str):
        self.path = path
        self.drive = is_drive_path(path)
        #: the FUSE mount the destination lies on (None: a local disk, or the Drive at DRIVE_ROOT)
        self.fuse_point = None if _under(path, DRIVE_ROOT) else fuse_mount_of(path)
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

    @property
    def drive_like(self) -> bool:
        """Whether the destination lies on Drive or another FUSE mount: written through the spool."""
        return self.drive or self.fuse_point is not None

    def check(self) -> None:
        """Raise :class:`MountVanished` when the destination is no longer where it was."""
        if self.fuse_point is not None:
            if fuse_mount_of(self.fuse_point) != self.fuse_point:  # unmounted: a plain folder of the disk
                what = "Google Drive" if self.drive else "the FUSE mount"
                raise MountVanished(self.path, f"{what} is not mounted at {self.fuse_point} any more")
        elif self.drive and not is_mount(DRIVE_ROOT):
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


def is_mount_error(exc: BaseException, local: bool = True) -> bool:
    """A vanished mount: the watch said so, or ENOTCONN from a local (FUSE-mounted) path."""
    return isinstance(exc, MountVanished) or (local and getattr(exc, "errno", None) == errno.ENOTCONN)
