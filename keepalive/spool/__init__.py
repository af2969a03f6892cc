"""Storage faults never stop training: a local spool, a background uploader, a bounded flush.

Google Drive's mount on Colab writes to the VM's disk first and syncs minutes later, loses its FUSE
daemon in long sessions (``Errno 107 Transport endpoint is not connected``), answers ``Errno 5`` when
the quota is full; object stores answer 503 and time out. None of that may stop training or lose a
checkpoint. So a checkpoint can be committed first to a **spool** on the VM's local disk and copied
to its destination by a background **uploader**. One concept per module:

* :mod:`~keepalive.spool.local` -- :class:`Spool`, a :class:`~keepalive.store.CheckpointStore` on
  local disk, one per destination run: ``$KEEPALIVE_SPOOL/<run>-<hash of the destination URL>/<run>/``
  (default root ``/tmp/keepalive-spool``) plus ``SPOOL.json`` naming the destination. A spooled
  commit is the very same manifest-last, checksummed, fsync'ed commit as any other, so a spooled
  checkpoint is durable on this machine the moment the writer returns.
* :mod:`~keepalive.spool.uploader` -- :class:`Uploader`, one thread per spool and process: copies
  spooled checkpoints newest first, verifies what landed, applies the destination's retention, keeps
  the newest uploaded one as a local cache, retries with backoff for as long as the process lives.
  Its jobs are its collaborators: :mod:`~keepalive.spool.backlog` (which checkpoint goes next, which
  are dropped or kept), :mod:`~keepalive.spool.transfer` (one checkpoint copied and verified),
  :mod:`~keepalive.spool.outage` (an outage told once when it begins, once when it ends; which errors
  no retry fixes), :mod:`~keepalive.spool.torn` (the torn folders of cut-short writes at the
  destination, removed by the lease holder after its next successful write).
* :mod:`~keepalive.spool.spooled` -- :class:`SpooledStore`, what :class:`keepalive.core.Checkpointer`'s
  writer commits through: the destination directly, or the spool (remote URLs and Drive always;
  failing or slow local paths from then on). It uses the uploader; the uploader calls back into it
  only through a listener (imports go one way). How long its flushes wait:
  :mod:`~keepalive.spool.flushing`.
* :mod:`~keepalive.spool.mount` -- :class:`MountWatch` / :class:`MountVanished` (a destination whose
  mount vanished), Colab's Drive.
* :mod:`~keepalive.spool.sync` -- :func:`sync`, ``keepalive sync``: upload what a crashed process left.

Which runs have a spool and what waits in it (``keepalive status``) is :mod:`keepalive.runs`' job.

Bounds:

* Training waits only for the *local* spool commit (the writer waits for the previous write, as
  before); nothing on the training thread talks to the remote side, except opening the run at the
  first save, which waits at most ``OPEN_TIMEOUT`` (5 s) for the uploader to take the destination's
  writer lease (so a run locked by another session is still reported at once), and resuming, which
  lists the destination (bounded by the store's retry policy).
* The spool holds at most ``KEEPALIVE_SPOOL_MAX`` bytes (default: half the free space of its disk
  when it is first needed). When the bound is hit the uploaded local copy goes first; un-uploaded
  checkpoints are dropped (oldest first, with a warning) only if ``keep`` newer checkpoints supersede
  them, never the newest; if that is not enough, a warning says so and nothing else is dropped.
* Flush (normal end, SIGTERM, atexit, deadline stop, ``Checkpointer.flush()``) waits for the uploads
  that matter (not those ``keep`` newer ones supersede) at most ``flush_timeout`` seconds (default
  120 s, ``KEEPALIVE_FLUSH_TIMEOUT``), never past the session's end, once (flushes in a row share one
  bound), and not at all for a destination that failed with an error no retry fixes (full,
  read-only, quota, permission) beyond one more attempt. What is still pending is printed with where
  it is and what to do (``keepalive sync``).

A vanished mount (the destination's folder disappears, a different filesystem sits there now, or
``ENOTCONN``) is reported once, with the remount command, and uploads resume by themselves when it is
back (reported once too). On Colab with a Drive destination every flush also calls ``os.sync()``; at
the end of a run ``google.colab.drive.flush_and_unmount()`` is called when asked (``drive_flush=True``
/ ``KEEPALIVE_DRIVE_FLUSH=1``), else the advice to call it is printed once.
"""
from __future__ import annotations

from .local import (
    SPOOL_RECORD,
    UPLOADED,
    Spool,
    list_spools,
    public_options,
    read_record,
    spool_dir_for,
    spool_root,
)
from .mount import DRIVE_ROOT, REMOUNT_HINT, MountVanished, MountWatch, is_drive_path
from .spooled import OPEN_TIMEOUT, SpooledStore, resolve_mode
from .sync import sync, sync_spool
from .uploader import UPLOADERS, Uploader, UploaderRegistry

__all__ = [
    "Spool", "Uploader", "UploaderRegistry", "UPLOADERS", "SpooledStore", "MountWatch", "MountVanished",
    "spool_root", "spool_dir_for", "resolve_mode", "list_spools", "read_record", "public_options",
    "is_drive_path", "sync", "sync_spool", "OPEN_TIMEOUT", "SPOOL_RECORD", "UPLOADED", "DRIVE_ROOT",
    "REMOUNT_HINT",
]
