""":class:`SpooledStore`, the store the checkpointer's writer commits through: the destination
directly, or the local spool plus the background uploader.

With ``spool="auto"`` (default) fsspec URLs (``gs://``, ``s3://``, ...) and paths on the Drive mount
(``/content/drive/...``) always go through the spool; other local paths are written directly and
switch to the spool when a direct write fails with a storage error (until the destination works
again and the spool is empty) or takes longer than ``KEEPALIVE_SPOOL_SLOW`` (10 s; then for the rest
of the session). ``spool=True`` / ``False`` (or ``KEEPALIVE_SPOOL_MODE=always|never``) force it.

How long a flush waits is :class:`~keepalive.spool.flushing.FlushWait`'s job; the torn folders that
failed direct writes leave are removed after the next one that succeeds
(:class:`~keepalive.spool.torn.TornFolders`).

Imports go one way: this module uses :mod:`~keepalive.spool.uploader` (through the uploader's
methods), and the uploader calls back into a store only through the listener the store attaches.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from .. import report, settings
from ..errors import LeaseLostError, RunLockedError
from ..store import CheckpointInfo, CheckpointStore, RetryPolicy, WriteResult
from ..units import format_bytes, parse_bytes
from .flushing import FlushWait
from .local import Spool, spool_dir_for
from .mount import (
    REMOUNT_HINT,
    MountWatch,
    describe_error,
    flush_and_unmount_drive,
    is_drive_path,
    is_mount_error,
    on_colab,
)
from .torn import TornFolders
from .uploader import UPLOADERS, Uploader

log = logging.getLogger("keepalive.spool")

OPEN_TIMEOUT = 5.0
_IN_PROCESS = {"memory"}  # fsspec protocols that are neither remote nor slow: written directly
_CONFIG_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EROFS, errno.EISDIR}

__all__ = ["SpooledStore", "resolve_mode", "OPEN_TIMEOUT"]


class _Generations:
    """Which spooled store is the newest for each spool folder in this process: a notebook cell run
    again builds a new one for the same run while the old one's uploads go on, and only the newest
    waits for uploads when it is flushed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._newest: Dict[str, int] = {}
        self._count = itertools.count(1)

    def new(self, folder: str) -> int:
        with self._lock:
            generation = next(self._count)
            self._newest[folder] = generation
            return generation

    def is_newest(self, folder: str, generation: int) -> bool:
        with self._lock:
            return self._newest.get(folder) == generation


_GENERATIONS = _Generations()


def resolve_mode(spool: Union[str, bool, None] = "auto") -> str:
    """``"auto"``, ``"always"`` or ``"never"`` from ``spool=`` (``"auto"`` defers to
    ``KEEPALIVE_SPOOL_MODE``)."""
    if spool is None or spool == "auto":
        return str(settings.get("KEEPALIVE_SPOOL_MODE"))
    if spool is True:
        return "always"
    if spool is False:
        return "never"
    try:
        return str(settings.SETTINGS["KEEPALIVE_SPOOL_MODE"].parse(str(spool)))
    except ValueError:
        raise ValueError(f"spool= takes 'auto', True or False, not {spool!r}") from None


class SpooledStore:
    """What the checkpointer's writer commits through: the destination directly, or the spool plus
    the background uploader (see the module docstring for when). Offers the writer-facing part of
    :class:`CheckpointStore` (``url``, ``run``, ``commit``, ``open_for_writing``, ``close``) plus
    :meth:`flush` and :meth:`local_spool`.

    ``quiet`` silences its news (:func:`keepalive.report.say`); problems are warnings
    (:func:`keepalive.report.warn`), shown whatever ``quiet`` says.
    """

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
                              else float(settings.get("KEEPALIVE_FLUSH_TIMEOUT")))
        self.drive_flush = (bool(settings.get("KEEPALIVE_DRIVE_FLUSH")) if drive_flush is None
                            else bool(drive_flush))
        self.slow_seconds = (float(slow_seconds) if slow_seconds is not None
                             else float(settings.get("KEEPALIVE_SPOOL_SLOW")))
        self.quiet = quiet
        self.remaining_fn = remaining_fn
        self.on_durable = on_durable
        self.root = root
        self.folder = spool_dir_for(dest.url, dest.run, root)
        self._max_bytes: Union[int, str, None] = (max_bytes if max_bytes is not None
                                                  else settings.get("KEEPALIVE_SPOOL_MAX"))
        self.local = dest.backend.local
        self.drive = self.local and is_drive_path(dest.path)
        self.mount = MountWatch(dest.path) if self.local else None
        self.spool: Optional[Spool] = None
        self.uploader: Optional[Uploader] = None
        self.takeover = False
        # why the spool is in use: "destination" (remote / Drive / forced), "failure", "slow", None
        self.reason: Optional[str] = None
        remote = not self.local and dest.url.split("://", 1)[0] not in _IN_PROCESS
        drive_like = self.mount is not None and self.mount.drive_like  # Drive, or any other FUSE mount
        if self.mode == "always" or (self.mode == "auto" and (remote or drive_like)):
            self.reason = "destination"
            if dest.retry == RetryPolicy():
                # The uploader retries for ever with its own backoff; the store's retries (5 attempts,
                # up to 5 s apart) would only delay a resume that can fall back to the spool.
                dest.retry = RetryPolicy(attempts=3, initial_delay=0.2, max_delay=1.0)
        elif self.mode == "auto" and os.path.isdir(self.folder) and self._spool().has_pending():
            self.reason = "failure"  # left over from an earlier session: upload those first
        self._generation = _GENERATIONS.new(self.folder)
        self._listener = self._uploaded  # one object: the uploader's registry finds it again on detach
        self._bound_warned = False
        self.flushes = FlushWait(dest.url, self.folder, self.flush_timeout, remaining_fn=remaining_fn,
                                 quiet=quiet)
        self.torn = TornFolders(dest)  # torn folders of failed direct writes, removed after the next one
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
        """The spool's bound in bytes (default: half the free space of its disk, when first needed)."""
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
        if up is not None and up.usable:
            return up
        self.uploader = UPLOADERS.attach(
            self.folder, self.dest, self.takeover, self._listener,
            lambda: Uploader(Spool(self.folder, self.dest.url, self.dest.run), self.dest, takeover=self.takeover,
                             bars=not self.quiet, mount=self.mount, quiet=self.quiet))
        return self.uploader

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
        if self.dest.seq_floor:  # the direct commits' count: spooled manifests continue it
            self._spool().seq_floor = max(self._spool().seq_floor, self.dest.seq_floor)
        up = self._attach()
        if up.note_outage(exc):
            advice = f"; on Colab remount Drive: {REMOUNT_HINT}" if is_mount_error(exc, self.local) else ""
            why = getattr(exc, "reason", None) or describe_error(exc)
            report.warn(f"{doing} at {self.url} failed ({why}). "
                        f"Training goes on; checkpoints are committed to this machine's disk in "
                        f"{self.folder} and uploaded in the background as soon as the destination works "
                        f"again{advice}", quiet=self.quiet)

    # ------------------------------------------------------------------------ writer-facing API
    def open_for_writing(self, takeover: bool = False) -> None:
        self.takeover = takeover
        if not self.spooling:
            try:
                if self.mount is not None:
                    self.mount.check()
                self.torn.opening()
                self.dest.open_for_writing(takeover=takeover)
                return
            except RunLockedError:
                raise
            except OSError as exc:
                if self.mode == "never" or (getattr(exc, "errno", None) in _CONFIG_ERRNOS
                                            and not is_mount_error(exc)):
                    raise
                self._switch(exc, "opening the run")
        self._open_spool()
        up = self._attach()
        up.open_destination(OPEN_TIMEOUT)
        if isinstance(up.fatal, RunLockedError):
            raise up.fatal

    def commit(self, files: Mapping[str, Any], *, step: int, epoch: Optional[int] = None,
               metadata: Optional[Mapping[str, Any]] = None,
               progress: Optional[Callable[[int], None]] = None) -> WriteResult:
        up = self.uploader
        if up is not None and up.fatal is not None:
            # the run belongs to another session now: stop writing to it (the writer re-raises this)
            raise up.fatal if isinstance(up.fatal, LeaseLostError) else LeaseLostError(str(up.fatal))
        if self.reason == "failure" and up is not None and up.caught_up():
            self.reason = None
            self.dest.forget_sequence()  # count on from what was uploaded meanwhile
            report.warn(f"writing checkpoints directly to {self.url} again", quiet=self.quiet)
        if not self.spooling:
            try:
                if self.mount is not None:
                    self.mount.check()
                result = self._commit_to_dest(up, files, step=step, epoch=epoch, metadata=metadata,
                                              progress=progress, clean=True)
            except (LeaseLostError, RunLockedError):
                raise
            except OSError as exc:
                if self.mode == "never":
                    raise
                self._switch(exc, f"writing the checkpoint of step {step}")
            else:
                if self.mode == "auto" and result.seconds > self.slow_seconds:
                    self.reason = "slow"
                    report.warn(f"writing step {step} to {self.url} took {result.seconds:.1f} s; from now "
                                f"on checkpoints are committed to local disk ({self.folder}) and uploaded "
                                "in the background so training does not wait for it", quiet=self.quiet)
                    self._open_spool()
                    self._attach()
                return result
        spool, up = self._spool_and_uploader()
        try:
            result = spool.commit(files, step=step, epoch=epoch, metadata=metadata, progress=progress)
        except (LeaseLostError, RunLockedError):
            raise
        except OSError as exc:
            # The spool's own disk failed (full?): the destination directly is the last resort.
            report.warn(f"spooling step {step} to {spool.url} failed ({describe_error(exc)}); writing it "
                        f"to {self.url} directly", quiet=self.quiet)

            def commit_directly() -> WriteResult:
                if not self.dest.lease.held:
                    self.dest.open_for_writing(takeover=self.takeover)
                return self.dest.commit(files, step=step, epoch=epoch, metadata=metadata, progress=progress)

            return up.exclusive(commit_directly)
        self._hand_to_uploader(spool, up)
        return result

    def sharded_target(self) -> "tuple[CheckpointStore, Callable[..., WriteResult]]":
        """Where every rank writes the files of a sharded (FSDP2) checkpoint itself, and how rank 0
        then commits it there (``commit(files, step=, epoch=, metadata=, name=, written=)``):
        the destination when checkpoints go to it directly and it is a local folder (committed under
        the uploader's lock, as :meth:`commit` does); else this machine's spool, whose uploader then
        sends the checkpoint on, manifest last. Ranks on other machines do not see this machine's
        spool: a multi-node job needs a run folder every machine mounts."""
        if not self.spooling:
            if not self.local:
                raise NotImplementedError(f"sharded (FSDP2 / DTensor) checkpoints to {self.url} are written "
                                          "through the local spool, and spool='never' was given")
            if self.mount is not None:
                self.mount.check()
            up = self.uploader
            return self.dest, lambda files, **kwargs: self._commit_to_dest(up, files, **kwargs)
        local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
        if local and world and int(local) < int(world):
            raise NotImplementedError(f"sharded (FSDP2 / DTensor) checkpoints of a job on several machines "
                                      f"need a run folder every machine sees (shared storage), not {self.url} "
                                      "through each machine's spool")
        spool, up = self._spool_and_uploader()

        def commit_spooled(files: Mapping[str, Any], **kwargs: Any) -> WriteResult:
            self._number_on(spool, up)  # the uploader may have opened the destination meanwhile
            result = spool.commit(files, **kwargs)
            self._hand_to_uploader(spool, up)
            return result

        return spool, commit_spooled

    def _commit_to_dest(self, up: Optional[Uploader], files: Mapping[str, Any], clean: bool = False,
                        **kwargs: Any) -> WriteResult:
        """Commit to the destination itself, under the uploader's lock when one runs (it writes there);
        ``clean``: then remove the torn folders earlier writes left (not on the sharded path, where
        other ranks may already write the next checkpoint's folder)."""
        def commit() -> WriteResult:
            result = self.dest.commit(files, **kwargs)
            if clean:
                self.torn.remove(committed=[result.info.name])
            return result

        return commit() if up is None else up.exclusive(commit)

    def _spool_and_uploader(self) -> "tuple[Spool, Uploader]":
        """This machine's spool and its uploader, the spool numbering on from what was uploaded."""
        spool = self._open_spool()
        up = self._attach()
        self._number_on(spool, up)
        return spool, up

    @staticmethod
    def _number_on(spool: Spool, up: Uploader) -> None:
        """The spool's next manifest continues the numbering the uploader knows of (the destination's
        newest, what other stores of this run spooled)."""
        spool.seq_floor = max(spool.seq_floor, up.seq_floor)

    def _hand_to_uploader(self, spool: Spool, up: Uploader) -> None:
        """After a commit into the spool: the uploader learns of it, the spool stays within its bound."""
        up.raise_seq_floor(spool.seq_floor)
        up.notify()
        self._enforce_bound(up)

    def _enforce_bound(self, up: Uploader) -> None:
        limit = self.max_bytes
        total, dropped = up.enforce_bound(limit)
        for c in dropped:
            report.warn(f"the spool is over its bound ({format_bytes(limit)}): dropped {c.name}, which "
                        f"{self.dest.keep} newer checkpoint(s) supersede (retention would remove it)",
                        quiet=self.quiet)
        if total <= limit:
            if not dropped:
                self._bound_warned = False
        elif not self._bound_warned:
            self._bound_warned = True
            report.warn(f"the spool {self.folder} holds {format_bytes(total)}, over its bound of "
                        f"{format_bytes(limit)} (KEEPALIVE_SPOOL_MAX); every spooled checkpoint is kept "
                        f"because none is superseded by keep={self.dest.keep} newer ones. Free disk space "
                        f"or fix the destination {self.url}.", quiet=self.quiet)

    def _uploaded(self, info: CheckpointInfo, seconds: float) -> None:
        """The uploader's listener (called on its thread, which logs what this raises): it copied
        ``info`` to the destination in ``seconds``, so it is durable there."""
        if self.on_durable is not None:
            self.on_durable(seconds)

    # --------------------------------------------------------------------------------- flush
    def pending(self) -> List[CheckpointInfo]:
        """Spooled checkpoints not uploaded yet, oldest first."""
        if self.uploader is not None:
            return self.uploader.pending()
        if self.spool is not None or os.path.isdir(self.folder):
            try:
                return self._spool().pending()
            except OSError:
                return []
        return []

    def flush(self, timeout: Optional[float] = None, *, end_of_run: bool = False) -> bool:
        """Wait (bounded, once, not for a destination that failed for good: :mod:`~keepalive.spool.flushing`)
        until the spool is settled: every spooled checkpoint that matters uploaded and verified, the
        local copies it supersedes evicted, the destination's retention applied; on Colab with a
        Drive destination also sync (and at the end of a run flush Drive when asked). True when
        nothing is left to do."""
        ok = True
        if not _GENERATIONS.is_newest(self.folder, self._generation):
            return True  # replaced by a newer store for this run: its uploads go on there
        # Not only "nothing pending": the last upload is marked done before the older local copy it
        # supersedes is evicted and before the destination's retention runs.
        if self.pending() or (self.uploader is not None and not self.uploader.settled()):
            ok = self.flushes.wait(self._attach(), timeout)
        if self.drive and on_colab():
            self._drive_sync(end_of_run, ok)
        return ok

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
            report.warn("not unmounting Drive yet: checkpoint uploads to it are still pending (see above)",
                        quiet=self.quiet)
            return
        self._end_done = True
        # Both lines below are warnings: after the first, Drive is gone until mounted again; the
        # second asks for an action without which the last checkpoints may never reach Drive.
        if self.drive_flush:
            try:
                flush_and_unmount_drive()
                report.warn("flushed Google Drive and unmounted it (drive_flush=True), so every "
                            f"checkpoint has reached Drive. Mount it again to keep using it: {REMOUNT_HINT}",
                            quiet=self.quiet)
            except Exception as exc:  # noqa: BLE001
                report.warn(f"drive.flush_and_unmount() failed ({describe_error(exc)}); Drive still syncs "
                            "in the background", quiet=self.quiet)
        else:
            report.warn("checkpoints are on the Drive mount, which uploads them to Google Drive in the "
                        "background (minutes for large files). Before this runtime ends, run "
                        "`from google.colab import drive; drive.flush_and_unmount()` to be sure they "
                        "reached Drive, or pass drive_flush=True (KEEPALIVE_DRIVE_FLUSH=1) to do it at the "
                        "end of training.", quiet=self.quiet)

    def close(self) -> None:
        """Release the spool's lease; uploads go on in the background until the spool is empty,
        then the destination's lease is released too."""
        if self.spool is not None:
            self.spool.close()
        up = self.uploader
        if up is None:
            # closed before (the end of the loop, then close()): an uploader still at work holds this
            # destination's lease and releases it after its last upload
            if not any(u.dest is self.dest and u.usable for u in UPLOADERS.values()):
                self.dest.close()
            return
        UPLOADERS.detach(up, self._listener)
        self.uploader = None

    # -------------------------------------------------------------------------------- resume
    def local_spool(self) -> Optional[Spool]:
        """This run's spool on this machine when it holds a run folder (what a resume looks at
        besides the destination, :class:`keepalive.runs.Run`), else None."""
        if os.path.isdir(os.path.join(self.folder, self.dest.run)):
            return self._spool()
        return None
