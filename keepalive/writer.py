"""Asynchronous checkpoint writes: training waits only for the copy to host memory.

At most one save is in flight. ``submit`` first waits for the previous write (so the reusable host
buffer is free again: host memory stays at about one extra copy of the state), copies the state's
tensors into that buffer, and hands the commit to a background thread. Errors of a background write
are logged and kept; a lost writer lease is re-raised at the next ``submit`` / ``wait`` because the
session must stop writing to that run.

A lazy snapshot (``submit(defer=...)``) leaves the tensors that cannot change before the next
optimizer step (its parameters and state) to the writer's thread: it copies them while the loop runs
the next forward and backward. Before that step changes them, the training thread calls
:meth:`AsyncWriter.settle`: it waits for what is not copied yet and checks every deferred tensor's
version counter. The write is committed only after that check passed; a tensor changed in place
before its copy (the copy may hold new values: not one state) drops the write, and ``settle``
returns its name.

Before a full copy is made, the writer asks the memory budget (:mod:`keepalive.memory`) whether it
fits. If not, the save streams (:mod:`keepalive.hoststream`): it is written while the training waits,
from the tensors' own memory or through a bounded buffer, with no full copy (a lazy snapshot falls
back to this too), and says so once. :meth:`AsyncWriter.release` gives the buffers back at the end of
the training. The writer's thread runs at a lower priority (``nice``), so on a
machine whose cores all train it takes what the training leaves (:data:`WRITER_NICE`, 0 for now).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Union

from . import report
from .errors import LeaseLostError
from .hoststream import StreamBuffer, Streamed, buffered, streamed_files
from .memory import MemoryBudget
from .state import Encoded, HostSnapshot, PendingCopy, TensorRef, prepare
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


#: how much lower than the training the writer's thread runs (Linux ``nice`` of the thread). 0 for
#: now: at +10 the write's end came so late on a busy 2-core machine that ``every="auto"`` did not
#: learn a write's cost within a short training (its line was never said)
WRITER_NICE = 0


def _lower_priority() -> None:
    """Make the calling thread yield to the training where they compete for cores (Linux: a thread
    is a task of its own for ``setpriority``; elsewhere nothing)."""
    if not WRITER_NICE:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError):  # pragma: no cover - not Linux, or not allowed
        pass


class _Verdict:
    """Whether a lazy snapshot is one state: set once by :meth:`AsyncWriter.settle`."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.changed: List[str] = []


class AsyncWriter:
    """Commits snapshots of the state in a background thread, one at a time."""

    def __init__(self, store: CommitTarget, *, background: bool = True,
                 memory_budget: Union[str, int, None] = None):
        self.store = store
        self.background = background
        self.snapshot = HostSnapshot()
        #: what a full host copy of the state may take (:mod:`keepalive.memory`); a state that does
        #: not fit is streamed through :attr:`stream` while the training waits
        self.budget = MemoryBudget(memory_budget)
        self.stream = StreamBuffer()
        #: the figures of the last save that was streamed (None: the last save made a full copy)
        self.streamed: Optional[Streamed] = None
        #: told the line of a streamed save (the checkpointer's ``warn``, once); None: said here
        self.on_stream: Optional[Callable[[str], None]] = None
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
        #: the lazy snapshot whose copy the training thread has not settled yet
        self._pending: Optional[PendingCopy] = None
        self._verdict: Optional[_Verdict] = None
        #: seconds the last settle waited for the background copy (a stall of the training too)
        self.settle_seconds = 0.0

    def reserve(self, tree: Any) -> None:
        """Prepare the host buffer of the first save (its size) ahead of it, if a full copy fits."""
        self.snapshot.reserve(tree, fits=self.budget.fits)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, tree: Any, *, step: int, epoch: Optional[int],
               metadata: Optional[Mapping[str, Any]] = None, sync: bool = False,
               check: Optional[Callable[[], Optional[str]]] = None,
               defer: Optional[Callable[[TensorRef], bool]] = None) -> Optional[WriteResult]:
        """Snapshot ``tree`` now and commit it (in the background unless ``sync``). ``check``, asked
        after the copy, names what changed while it was copied (:class:`SnapshotChanged`: nothing is
        committed). ``defer``: the tensors the writer's thread copies later (a lazy snapshot; only
        for a background write: the caller must :meth:`settle` before they may change)."""
        self.wait()
        lazy = defer is not None and self.background and not sync and check is None
        t0 = time.perf_counter()
        encoded = prepare(tree)
        held = self.snapshot.held()
        if encoded.size > held and not self.budget.fits(encoded.size, held):
            files = self._streamed_files(encoded, checked=check is not None)
        else:
            self.streamed = None
            files = self.snapshot.fill(encoded, defer=defer if lazy else None)
        self.snapshot_seconds = time.perf_counter() - t0
        changed = check() if check is not None else None
        if changed:
            raise SnapshotChanged(changed)
        job: Dict[str, Any] = dict(files=files, step=step, epoch=epoch, metadata=dict(metadata or {}))
        if sync or not self.background or self.streamed is not None:  # a streamed save reads the live state
            self._run(job)
            return self.wait()
        pending = self.snapshot.pending
        if pending is not None:
            self._pending, self._verdict = pending, _Verdict()
            job.update(pending=pending, verdict=self._verdict)
        # Not a daemon: an interpreter that exits normally finishes the write first.
        self._thread = threading.Thread(target=self._run, args=(job,), name="keepalive-writer")
        self._thread.start()
        return None

    def _streamed_files(self, encoded: Encoded, *, checked: bool) -> Dict[str, Any]:
        """The files of a save that streams (no full copy fits): the full buffer given back, the
        line said (once). A save that must prove the state unchanged after its copy (a save between
        steps, from another thread) cannot stream, the state being read while it is written: it is
        refused, and the next boundary saves."""
        if checked:
            raise SnapshotChanged("the state does not fit in memory for a copy; it is streamed at the next boundary")
        self.snapshot.release()
        limit = self.budget.limit() or 0
        piece = min(self.budget.piece_bytes(limit), -(-encoded.size // 4096) * 4096)  # (never above the state)
        self.streamed = Streamed(encoded.size, limit, piece, self.budget.source(), buffered(encoded.tensors))
        line = self.streamed.line()
        if self.on_stream is not None:
            self.on_stream(line)
        else:
            report.warn(line, key=f"{self.store.url}:save-streamed")
        return streamed_files(encoded, self.stream, self.streamed.piece)

    def release(self) -> None:
        """Give back the host buffers (the full copy's, the streamed saves' bounded one) when no
        write is in flight: the training is over. The next save allocates what it needs again."""
        if self._thread is not None or self._pending is not None:
            return  # still in use: the caller waits for the write first
        self.snapshot.release()
        self.stream.release()

    @property
    def unsettled(self) -> bool:
        """Whether a lazy snapshot's tensors wait to be checked (:meth:`settle`) before they may change."""
        return self._pending is not None

    def settle(self) -> List[str]:
        """Before the deferred tensors may change (an optimizer step): wait until the lazy snapshot's
        copy is done, then check that none of them was changed in place meanwhile. Returns the keys
        of those that were (the write is dropped then); [] when nothing is pending or all is well.
        Called by the thread that trains (its in-place operations have finished when it gets here)."""
        pending, verdict = self._pending, self._verdict
        if pending is None or verdict is None:
            return []
        t0 = time.perf_counter()
        pending.wait(help=True)
        self.settle_seconds = time.perf_counter() - t0
        changed = pending.changed()
        self._pending = self._verdict = None
        verdict.changed = changed
        verdict.event.set()
        return changed

    def _run(self, job: Dict[str, Any]) -> None:
        bar = None
        try:
            pending: Optional[PendingCopy] = job.get("pending")
            if pending is not None:
                pending.run()  # at the training's priority: the next step waits for it
                if pending.error is not None:
                    raise pending.error
                verdict: _Verdict = job["verdict"]
                while not verdict.event.wait(0.2):
                    if not threading.main_thread().is_alive():
                        # the interpreter is exiting: no training thread will change the tensors (or
                        # settle) any more, so the check is safe from here
                        self.settle()
                if verdict.changed:
                    return  # not one state: nothing is committed (the caller saves again)
            if threading.current_thread() is self._thread:
                _lower_priority()  # the write yields to the training (its own thread: it ends with it)
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
        self.settle()
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
