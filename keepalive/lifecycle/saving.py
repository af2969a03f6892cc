"""What happens at a save, from the writer lease to the durable checkpoint.

A save (:meth:`Saver.save`, under the boundary machine's lock) takes the run's writer lease if this
checkpointer does not hold it yet (:meth:`Saver.open`: a checkpointer of this process whose loop is
over hands it over), builds the state tree (:meth:`Saver.build_tree`: the header, the counters, the
adapter's capture, the plan, the random state), and hands it to the save path chosen at first use
(:mod:`keepalive.savepath`: one writer, gathered to rank 0, or DCP's pieces). The training waits only
for the copy to host memory; with a lazy snapshot (:mod:`keepalive.lifecycle.snapshots`) not even for
all of that. The write and the uploads go on in the background: :meth:`Saver.flush` waits for them,
and once the training is over :meth:`Saver.give_back_lease` releases the lease for another session.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from .. import boundary as bd
from .. import distributed as _distributed
from .. import notebook, rng
from .. import pauses as _pauses
from .. import rendezvous as _rendezvous
from .. import session as _session
from ..runidentity import announce_first_save
from ..runs import record_run
from ..savepath import SavePath, choose
from ..statetree import Header, StateTree
from ..store import WriteResult
from . import Capture

if TYPE_CHECKING:
    from ..core import Checkpointer

log = logging.getLogger("keepalive")

STATE_FORMAT = 1

#: the checkpointers alive in this process (a new one on the same run takes the lease over)
ALIVE: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()

__all__ = ["ALIVE", "STATE_FORMAT", "Saver"]


class Saver:
    """The saves of ``ckpt``: its writer lease, its save path, the tensors of its newest state tree."""

    def __init__(self, ckpt: "Checkpointer"):
        self.ckpt = ckpt
        self._path: Optional[SavePath] = None
        #: this checkpointer holds the run's writer lease
        self.opened = False
        self._reserved = False
        #: the tensors of the newest state tree built (their version counters prove nothing changed)
        self.tracked: List[Any] = []

    @property
    def path(self) -> SavePath:
        """:attr:`keepalive.core.Checkpointer.path`: chosen once, at first use."""
        if self._path is None:
            ckpt = self.ckpt
            self._path = choose(ckpt.writer, _distributed.GROUP, ckpt.dcp_objects, ckpt.spooled,
                                ckpt.on_commit, ckpt.url)
            if _distributed.GROUP.active:
                problem = _rendezvous.unguarded_group_problem()
                if problem:
                    ckpt.warn(problem, key="unguarded-rendezvous")
        return self._path

    def open(self) -> None:
        """Take the run's writer lease (one process writes, under DDP rank 0: it alone holds it)."""
        ckpt = self.ckpt
        if not self.path.writes or self.opened:
            return
        # A cell run again builds a new checkpointer for the run while the old one (its loop over)
        # holds the lease: hand it over. A lease of this process that none of its checkpointers holds
        # (one dropped without close(), e.g. garbage-collected) is taken back, not a lock-out.
        others = [o for o in list(ALIVE) if o is not ckpt and o.saver.opened and o.store.url == ckpt.store.url]
        for other in others:
            if not other.in_loop:
                other.close(raise_stop=False)  # its training call is over: nothing to raise there now
        orphaned = (not ckpt.spooled.spooling and not any(o.saver.opened for o in others)
                    and ckpt.store.lease.names_this_process())
        ckpt.spooled.open_for_writing(takeover=ckpt.takeover or orphaned)
        # found after a reset (RUNS.json), by its absolute location: a relative path means nothing
        # to another process, and the magics compare it with the run a cell wrote
        record_run(ckpt.store.url, _session.platforms.run_index_dir)
        self.opened = True

    def give_back_lease(self) -> None:
        """The training is over (finished, stopped, its loop left): after the write in flight is
        durable, release the writer lease, so that another session (a second notebook on the same
        run) may open the run while this kernel idles. A later save of this checkpointer takes the
        lease again."""
        if self.opened:
            if self._path is not None:
                self._path.wait()
            self.ckpt.writer.wait()
        self.ckpt.writer.release()  # the host copy's buffers: the notebook's next cells get the memory back
        # also when given back before: waiting for uploads (flush) attaches the uploader again
        self.ckpt.spooled.close()  # uploads go on; the destination's lease is released after the last
        self.opened = False

    def reserve(self, capture: Capture) -> None:
        """At the first boundary: the first save's host buffer, prepared while the training runs."""
        if self._reserved:
            return
        self._reserved = True
        try:
            tree = self.ckpt.build_tree(capture)
            self.tracked = _pauses.tensors_of(tree)
            self.path.reserve(tree)
        except Exception as exc:  # noqa: BLE001 - an optimisation only; the save will say more
            log.debug("could not reserve the snapshot buffer: %s", exc)

    def build_tree(self, capture: Capture, rng_state: Optional[Dict[str, Any]] = None) -> StateTree:
        """:meth:`keepalive.core.Checkpointer.build_tree`."""
        ckpt = self.ckpt
        c = ckpt.state.counters
        header: Header = {"format": STATE_FORMAT, "framework": ckpt.framework}
        if ckpt.epoch_batches:
            header["epoch_batches"] = int(ckpt.epoch_batches)
        tree: StateTree = {"keepalive": header,
                           "counters": {"epoch": c.epoch, "step": c.step, "batch": c.batch, "samples": c.samples},
                           "extras": dict(ckpt.extras)}
        tree.update(capture())
        if ckpt.plan:
            tree["plan"] = dict(ckpt.plan)
        tree["rng"] = rng.capture() if rng_state is None else rng_state
        return tree

    def save(self, capture: Capture, *, sync: bool, reason: str, finished: bool, tree: Optional[StateTree],
             check: Optional[Callable[[], Optional[str]]]) -> None:
        """:meth:`keepalive.core.Checkpointer.save`, under the boundary machine's lock."""
        ckpt = self.ckpt
        self.open()
        if reason != "by hand" and threading.current_thread() is threading.main_thread():
            # a loop in another cell than the one that made the checkpointer
            notebook.record_context(ckpt.metadata, refresh=True)
        c = ckpt.state.counters
        meta = dict(ckpt.metadata, reason=reason, finished=finished, counters=c.as_dict())
        ckpt.store.lease.progress = c.as_dict()
        log.info("saving step %d (epoch %d): %s", c.step, c.epoch, reason)
        ckpt.steps_paused = True
        started = time.perf_counter()
        try:
            if tree is None:
                tree = ckpt.build_tree(capture)
            self.tracked = _pauses.tensors_of(tree)
            ckpt.writer.on_stream = self.say_streamed
            if check is not None:
                ckpt.writer.submit(tree, step=c.step, epoch=c.epoch, metadata=meta, sync=sync, check=check)
            else:
                defer = ckpt.snapshots.prepare(reason=reason, step=c.step, sync=sync)
                self.path.submit(tree, step=c.step, epoch=c.epoch, metadata=meta, sync=sync, defer=defer)
        finally:
            ckpt.steps_paused = False
        if not sync:  # what the training waited for: the copy to host memory (a sync save waits for all)
            ckpt.trigger.record_stall(time.perf_counter() - started)
        ckpt.machine.feed(bd.Saved())
        ckpt.trigger.saved()
        announce_first_save(ckpt, ckpt.say)  # a run never interrupted shows that it is protected, and where

    def say_streamed(self, line: str) -> None:
        """The state does not fit in memory for a copy: its saves stream (said once per run)."""
        self.ckpt.warn(line, key="save-streamed")

    def committed(self, result: WriteResult) -> None:
        """Each committed checkpoint, whatever the save path: its cost teaches the schedule."""
        self.ckpt.trigger.record_save(result.seconds)

    def flush(self, timeout: Optional[float] = None) -> None:
        """:meth:`keepalive.core.Checkpointer.flush`."""
        ckpt = self.ckpt
        ckpt.snapshots.settle()
        if self._path is not None:
            self._path.wait(timeout)
        ckpt.writer.wait(timeout)
        ckpt.spooled.flush(timeout, end_of_run=ckpt.finished or ckpt.stopped)
        if not ckpt.in_loop:  # the training loop is over (ended, stopped, left): the run is free
            self.give_back_lease()
            ckpt.stops.raise_stop()

    def close(self) -> None:
        """The last part of :meth:`keepalive.core.Checkpointer.close`: the spool and the save path
        closed, the lease no longer held."""
        self.ckpt.spooled.close()
        if self._path is not None:
            self._path.close()
        self.ckpt.writer.release()
        self.opened = False
