"""Asynchronous checkpoint writes: training waits only for the copy to host memory.

At most one save is in flight. ``submit`` first waits for the previous write (so the reusable host
buffer is free again: host memory stays at about one extra copy of the state), copies the state's
tensors into that buffer, and hands the commit to a background thread. Errors of a background write
are logged and kept; a lost writer lease is re-raised at the next ``submit`` / ``wait`` because the
session must stop writing to that run.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, List, Mapping, Optional, Protocol

from . import report
from .errors import LeaseLostError
from .state import HostSnapshot
from .store import WriteResult

log = logging.getLogger("keepalive.writer")


class CommitTarget(Protocol):
    """Where the writer commits: a :class:`~keepalive.store.CheckpointStore`, or the
    :class:`~keepalive.spool.SpooledStore` in front of one."""

    url: str

    def commit(self, files: Mapping[str, Any], *, step: int, epoch: Optional[int] = None,
               metadata: Optional[Mapping[str, Any]] = None,
               progress: Optional[Callable[[int], None]] = None) -> WriteResult: ...


class SnapshotChanged(RuntimeError):
    """The state changed while it was copied to host memory: the copy is not one state."""


class AsyncWriter:
    """Commits snapshots of the state in a background thread, one at a time."""

    def __init__(self, store: CommitTarget, *, background: bool = True):
        self.store = store
        self.background = background
        self.snapshot = HostSnapshot()
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[WriteResult] = None
        self._error: Optional[BaseException] = None
        self.last_result: Optional[WriteResult] = None
        self.last_error: Optional[BaseException] = None
        self.snapshot_seconds: Optional[float] = None
        #: called with each WriteResult after a commit (e.g. the trigger's save-time measurement)
        self.on_commit: List[Callable[[WriteResult], None]] = []
        self.progress: Optional[Callable[[int], None]] = None
        #: ``factory(files, step)`` -> None or a per-write progress object with ``update(n_bytes)``
        #: and ``close()`` (the tqdm upload bar of :mod:`keepalive.progress`)
        self.progress_factory: Optional[Callable[[Mapping[str, Any], int], Any]] = None

    def reserve(self, tree: Any) -> None:
        """Prepare the host buffer of the first save (its size) ahead of it."""
        self.snapshot.reserve(tree)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, tree: Any, *, step: int, epoch: Optional[int],
               metadata: Optional[Mapping[str, Any]] = None, sync: bool = False,
               check: Optional[Callable[[], Optional[str]]] = None) -> Optional[WriteResult]:
        """Snapshot ``tree`` now and commit it (in the background unless ``sync``). ``check``, asked
        after the copy, names what changed while it was copied (:class:`SnapshotChanged`: nothing is
        committed)."""
        self.wait()
        t0 = time.perf_counter()
        files = self.snapshot.take(tree)
        self.snapshot_seconds = time.perf_counter() - t0
        changed = check() if check is not None else None
        if changed:
            raise SnapshotChanged(changed)
        job = dict(files=files, step=step, epoch=epoch, metadata=dict(metadata or {}))
        if sync or not self.background:
            self._run(job)
            return self.wait()
        # Not a daemon: an interpreter that exits normally finishes the write first.
        self._thread = threading.Thread(target=self._run, args=(job,), name="keepalive-writer")
        self._thread.start()
        return None

    def _run(self, job) -> None:
        bar = None
        try:
            progress = self.progress
            if self.progress_factory is not None:
                bar = self.progress_factory(job["files"], job["step"])
                if bar is not None:
                    progress = bar.update if self.progress is None else _both(self.progress, bar.update)
            result = self.store.commit(job["files"], step=job["step"], epoch=job["epoch"],
                                       metadata=job["metadata"], progress=progress)
            self._result = result
            for cb in self.on_commit:
                cb(result)
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            self._error = exc
        finally:
            if bar is not None:
                bar.close()

    def wait(self, timeout: Optional[float] = None) -> Optional[WriteResult]:
        """Block until the in-flight write (if any) is committed; returns its result.

        A failed write is logged; :class:`LeaseLostError` is raised (the run belongs to someone
        else now). With ``timeout`` the wait may return early with the write still in flight.
        """
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return None
            self._thread = None
        result, error = self._result, self._error
        self._result = self._error = None
        if result is not None:
            self.last_result = result
        if error is not None:
            self.last_error = error
            if isinstance(error, LeaseLostError):
                raise error
            report.warn(f"checkpoint write to {self.store.url} failed ({type(error).__name__}: {error}); "
                        "the previous checkpoint stays the newest, training goes on")
        return result


def _both(a: Callable[[int], None], b: Callable[[int], None]) -> Callable[[int], None]:
    def progress(n: int) -> None:
        a(n)
        b(n)
    return progress
