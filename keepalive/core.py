"""The framework-neutral checkpointer every adapter is built on.

An adapter says where the boundaries are (:meth:`Checkpointer.advance` after a batch,
:meth:`Checkpointer.end_epoch`, :meth:`Checkpointer.end_stage`; optimizer steps through
:meth:`Checkpointer.optimizer_stepped`), captures its objects' state as a tree and restores one
(:mod:`keepalive.adapter`: the contract). Everything else lives here and below: what a boundary does
(save, stop, re-raise a signal) is decided by the pure state machine of :mod:`keepalive.boundary`, fed
the schedule's answer (:mod:`keepalive.trigger`), and only carried out here; a checkpoint leaves the
process by the save path of :mod:`keepalive.savepath` (one writer, gathered to rank 0, or in pieces
through DCP), chosen once when the run is first used; resume with fallback (:mod:`keepalive.runs`),
RNG capture (:mod:`keepalive.rng`), deferred interrupts (:mod:`keepalive.interrupts`) and the
one-line messages users see.

The tree a checkpoint holds (:mod:`keepalive.statetree` names its keys)::

    {"keepalive": {"format": 1, "framework": "torch"},
     "counters":  {"epoch": 3, "step": 1200, "batch": 0, "samples": 153600},
     "objects":   {"model": {...state_dict...}, "optimizer": {...}, ...},   # adapter's capture()
     "data":      {...sampler seed / position...},                          # adapter's capture()
     "rng":       {"python": ..., "numpy": ..., "torch_cpu": ..., ...},
     "extras":    {...user values...}}
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Mapping, MutableMapping, Optional, Set, Tuple, Union, cast

from . import boundary as bd
from . import distributed as _distributed
from . import notebook, report, rng
from . import pauses as _pauses
from . import progress as _progress
from . import rendezvous as _rendezvous
from . import session as _session
from . import spool as _spool
from .config import CheckpointConfig
from .errors import TrainingStopped
from .interrupts import DeferredSignals, raise_for, signal_name
from .notebook import default_dir, resolve_run_url
from .runs import Run, position, record_run, resuming_line
from .savepath import Found, SavePath, choose
from .session import cloud as _cloud
from .statetree import Captured, Header, StateTree
from .store import CheckpointInfo, CheckpointStore, WriteResult
from .trigger import SaveTrigger
from .units import format_duration
from .writer import AsyncWriter, SnapshotChanged

log = logging.getLogger("keepalive")

STATE_FORMAT = 1
Capture = Callable[[], Captured]
Decision = bd.Decision

_ACTIVE: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()
#: per run URL, the plans of the fits (stages) this process trained to their end, in order: a new
#: callback on the path of a fit this process just finished starts the next stage, not a resume
_TRAINED_HERE: Dict[str, List[Dict[str, Any]]] = {}
#: per run URL, the objects (a model, a learner) those fits trained: the same object fit again is a
#: further stage, one built anew (a script or cell run again) a resume
_TRAINED_OBJECTS: Dict[str, "weakref.WeakSet[Any]"] = {}


def active_checkpointers() -> List["Checkpointer"]:
    """The checkpointers alive in this process (the magics use it to find the run a cell trained)."""
    return list(_ACTIVE)


class Checkpointer:
    """Where, when and how a training run is checkpointed and resumed (see module docstring).

    ``Checkpointer(path, every=..., keep=..., ...)`` or ``Checkpointer(config=CheckpointConfig(...))``:
    the options are those of :class:`keepalive.config.CheckpointConfig`.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]", None] = None, *,
                 config: Optional[CheckpointConfig] = None, framework: str = "generic",
                 **options: Any):
        cfg = CheckpointConfig.strict(path, config, options, "Checkpointer")
        self.config = cfg
        self.url = resolve_run_url(cfg.path, cfg.run, say=lambda line: report.say(
            line, quiet=cfg.quiet or not _distributed.GROUP.is_main))
        self.store = CheckpointStore(self.url, keep=cfg.keep, keep_every=cfg.keep_every,
                                     storage_options=cfg.storage_options)
        self.trigger = SaveTrigger(cfg.every, on_deadline=cfg.on_deadline, margin=cfg.deadline_margin,
                                   remaining_fn=cfg.remaining_fn, on_preempt=cfg.on_preempt,
                                   notice_fn=_cloud_notice)
        #: what the writer commits through: the store itself, or a local spool whose checkpoints a
        #: background thread uploads (remote URLs, Drive, failing destinations: keepalive/spool)
        self.spooled = _spool.SpooledStore(self.store, cfg.spool, storage_options=cfg.storage_options,
                                        flush_timeout=cfg.flush_timeout, drive_flush=cfg.drive_flush,
                                        quiet=cfg.quiet, remaining_fn=self.trigger.remaining,
                                        on_durable=self.trigger.record_save)
        self.writer = AsyncWriter(self.spooled, background=cfg.background)
        #: called with each WriteResult after a checkpoint is committed, whatever the save path
        self.on_commit: List[Callable[[WriteResult], None]] = self.writer.on_commit
        self.on_commit.append(self._committed)
        if not cfg.quiet:
            self.writer.progress_factory = _progress.upload_progress(self.url)
        self.framework = framework
        self.takeover = cfg.takeover
        self.quiet = cfg.quiet
        #: the boundary state machine's state (:mod:`keepalive.boundary`); changed only by _feed. The
        #: training thread's boundaries and the pause guard's save take turns through the lock
        self._lock = threading.RLock()
        self.state = bd.BoundaryState()
        self.counters: MutableMapping[str, int] = bd.CounterView(lambda: self.state.counters, self._feed)
        self.extras: Dict[str, Any] = {}
        self.metadata: Dict[str, Any] = {"framework": framework}
        self.resumed_from: Optional[CheckpointInfo] = None
        #: what the training code asks for (:mod:`keepalive.plan`), set by the adapter; saved with
        #: every checkpoint; ``saved_plan`` is the loaded checkpoint's (None: a new run, or an older one)
        self.plan: Dict[str, Any] = {}
        self.saved_plan: Optional[Dict[str, Any]] = None
        #: objects whose state DCP saves in pieces, one per rank (set by the torch adapter before use)
        self.dcp_objects: Any = None
        self._path: Optional[SavePath] = None
        self._opened = False
        self._reserved = False
        self.signals = DeferredSignals(lambda: self.state.pending.signal, self._forget_signal,
                                       announce=lambda: not _distributed.GROUP.active,
                                       noted=self._wake_guard)
        # Saves between steps (keepalive/pauses.py): the mark is the state at the last consistent boundary
        self._mark: Optional[_pauses.Mark] = None
        self._last_capture: Optional[Capture] = None
        self._last_call = time.monotonic()
        #: the tensors of the newest state tree built (their version counters prove nothing changed)
        self._tracked: List[Any] = []
        #: the adapter's cheap summary of what it captures beside tensors, as a pair: (the objects'
        #: state, e.g. a scheduler's step count; the loop's position, e.g. batches handed out). A save
        #: between steps is made only while both are what they were at the last boundary; a moved
        #: position means a training step is under way (no pause: the next boundary saves)
        self.fingerprint: Optional[Callable[[], Tuple[Any, Any]]] = None
        #: closed by the guard while it copies the state; optimizer steps wait at it (torch adapters)
        self.step_gate = _pauses.StepGate()
        if cfg.snapshot not in ("lazy", "blocking"):
            raise ValueError(f"snapshot={cfg.snapshot!r}: use 'lazy' (the default) or 'blocking'")
        self.step_gate.before_step = weakref.WeakMethod(self._settle_snapshot)
        #: keys of tensors a lazy snapshot found changed in place before their copy: copied at once
        self._copy_at_once: Set[str] = set()
        self._lazy_reason: Optional[str] = None
        #: more tensors a save may copy after the loop went on (an adapter's, whose framework changes
        #: them only in an optimizer step and calls :meth:`settle_snapshot` before it)
        self.lazy_sources: List[Callable[[], Iterable[Any]]] = []
        self._lazy_step = 0
        self._guard: Optional[_pauses.PauseGuard] = None
        #: what came due during a pause and could not be saved there: owed to the next boundary
        self._owed = bd.Due()
        self._refusal_told = False
        #: what to change so that a save during a pause is possible (the adapter knows its framework)
        self.pause_hint = ("To have it saved at once during an evaluation, step an epoch's scheduler (or update an "
                           "EMA) after the evaluation, not between the training batches and it")
        #: why the adapter's loop cannot be saved inside an epoch (said when an interrupt comes)
        self.mid_epoch_obstacle: Optional[str] = None
        self._in_loop = False
        #: the number of epochs, when the adapter knows it (for the ETA next to the session time)
        self.total_epochs: Optional[int] = None
        self._progress: Any = False  # the training progress bar, made on first use
        #: steps of the watched optimizers so far in this process (all of them; never reset), and how
        #: many optimizers are watched (their step hooks call optimizer_stepped: torchstate.watch_steps)
        self.optimizer_steps = 0
        self.watched = 0
        self.steps_paused = False  # while state is saved or restored: optimizer steps are not training
        #: batches in one epoch (the batch counter at an epoch's end), learned at the first epoch end
        #: and kept in the checkpoint; an adapter that knows it may set it. With ``total_epochs`` it
        #: tells the training's last batch, whose scheduled save the end-of-training save makes.
        self.epoch_batches: Optional[int] = None
        #: in a notebook, the stop before the deadline the end of the training call raises (once)
        self._stop_to_raise: Optional[str] = None
        self._budget_told = False
        notebook.record_context(self.metadata)  # the notebook cell, or the script, that made the run
        _ACTIVE.add(self)

    # ------------------------------------------------------------------------- state machine
    def _feed(self, event: bd.Event) -> Decision:
        with self._lock:  # the pause guard's thread feeds events too
            self.state, decision = bd.transition(self.state, event)
        return decision

    @property
    def finished(self) -> bool:
        return self.state.finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self._feed(bd.Finish(bool(value)))

    @property
    def stopped(self) -> bool:
        return self.state.stopped

    @property
    def stop_reason(self) -> Optional[str]:
        return self.state.stop_reason

    @property
    def pending_signal(self) -> Optional[int]:
        """A signal received and not acted on yet (saved at the next consistent boundary)."""
        return self.state.pending.signal if self.state.pending.signal is not None else self.signals.peek()

    @property
    def path(self) -> SavePath:
        """How checkpoints leave this process (:mod:`keepalive.savepath`), chosen once, at first use."""
        if self._path is None:
            self._path = choose(self.writer, _distributed.GROUP, self.dcp_objects, self.spooled,
                                self.on_commit, self.url)
            if _distributed.GROUP.active:
                problem = _rendezvous.unguarded_group_problem()
                if problem:
                    self.warn(problem, key="unguarded-rendezvous")
        return self._path

    @property
    def training_progress(self) -> Optional[_progress.TrainingProgress]:
        """The epoch progress bar (by the process that writes checkpoints; None with ``quiet``)."""
        if self._progress is False:
            self._progress = None if self.quiet or not self.path.writes else _progress.TrainingProgress(self)
        return self._progress

    def optimizer_stepped(self, index: int = 0) -> None:
        """A watched optimizer (``index`` of those watched) stepped: boundaries count such steps
        (not while a checkpoint is saved or restored: DCP initialises an optimizer's state by a step)."""
        if not self.steps_paused:
            self.optimizer_steps += 1
            self._feed(bd.OptimizerStep(index))

    # ------------------------------------------------------------------------------- messages
    def say(self, message: str) -> None:
        """News for the user, silenced by ``quiet=True``; said by the process that writes only."""
        report.say(message, quiet=self.quiet or not self.path.writes)

    def warn(self, message: str, key: Optional[str] = None, own: bool = False) -> None:
        """A problem the user must see (not silenced by ``quiet``); once per ``key`` and run. Under a
        process group every rank runs the same code and finds the same problems: rank 0 says them,
        the others only log them. ``own``: a problem of this rank alone (its view of the run folder,
        its data), said by this rank, named."""
        group = _distributed.GROUP
        if group.active:
            if not own and not group.is_main:
                log.debug("said by rank 0: %s", message)
                return
            if own:
                message = f"rank {group.rank}: {message}"
        report.warn(message, key=None if key is None else f"{self.url}:{key}", quiet=self.quiet)

    # --------------------------------------------------------------------------------- resume
    def load(self, describe: Optional[Callable[[StateTree], str]] = None,
             check: Optional[Callable[[StateTree], None]] = None) -> Optional[StateTree]:
        """The newest valid checkpoint's state tree (falling back past corrupt ones), or None.
        ``check(tree)`` runs first and may raise (e.g. ``StateMismatchError``): then nothing changes,
        and ``load`` after fixing the objects tries again. Otherwise sets the counters and extras and
        says in one line what is resumed, with ``describe(tree)``'s words (e.g. what is restored)."""
        # the run = its destination and this machine's spool of it: the newest valid checkpoint of both
        found = cast(Optional[Found], Run(self.store, spool=self.spooled.local_spool()).load_newest(quiet=self.quiet))
        # Take the writer lease now, at the start of training: a second session on the same run
        # learns it at once instead of after its first epoch.
        self._open()
        self._tell_budget_used_up()
        found = self.path.localize(found, self.url, lambda text: self.warn(text, key="world-size"))
        if found is None:
            return None
        info, tree, previous = found
        if check is not None:
            self.resumed_from = info  # for the check's messages; reset if it refuses
            try:
                check(tree)
            except BaseException:
                self.resumed_from = None
                raise
        self.resumed_from = info
        self.saved_plan = dict(tree.get("plan") or {}) or None
        self._feed(bd.Restored(bd.Counters.of(tree.get("counters") or {})))
        # until the first boundary, the checkpoint is the state: a signal during a pause before it (the
        # validation of an epoch resumed at its end) needs no new save
        self._mark = _pauses.Mark(counters=self.state.counters, rng=None, optimizer_steps=self.optimizer_steps,
                                  versions=-1, fingerprint=None, at=time.monotonic())
        header = tree.get("keepalive")
        saved_length = header.get("epoch_batches") if header else None
        if self.epoch_batches is None and isinstance(saved_length, int) and saved_length > 0:
            self.epoch_batches = saved_length
        self.extras.update(tree.get("extras") or {})
        self.trigger.saved()
        if not self.quiet:
            words = (lambda: describe(tree)) if describe is not None else None
            self.say(resuming_line(self.store.run, info, self.state.counters.as_dict(), previous, words))
        return tree

    def restore_rng(self, tree: Mapping[str, Any]) -> None:
        if tree.get("rng"):
            rng.restore(tree["rng"])

    # ----------------------------------------------------------------------------------- save
    def _open(self) -> None:
        if not self.path.writes or self._opened:
            return  # one process writes (under DDP rank 0): it alone holds the writer lease
        # A cell run again builds a new checkpointer for the run while the old one (its loop over)
        # holds the lease: hand it over. A lease of this process that none of its checkpointers holds
        # (one dropped without close(), e.g. garbage-collected) is taken back, not a lock-out.
        others = [o for o in list(_ACTIVE) if o is not self and o._opened and o.store.url == self.store.url]
        for other in others:
            if not other._in_loop:
                other._stop_to_raise = None  # its training call is over: nothing to raise there now
                other._close()
        orphaned = (not self.spooled.spooling and not any(o._opened for o in others)
                    and self.store.lease.names_this_process())
        self.spooled.open_for_writing(takeover=self.takeover or orphaned)
        # found after a reset (RUNS.json), by its absolute location: a relative path means nothing
        # to another process, and the magics compare it with the run a cell wrote
        record_run(self.store.url, _session.platforms.run_index_dir)
        self._opened = True

    def _give_back_lease(self) -> None:
        """The training is over (finished, stopped, its loop left): after the write in flight is
        durable, release the writer lease, so that another session (a second notebook on the same
        run) may open the run while this kernel idles. A later save of this checkpointer takes the
        lease again."""
        if self._opened:
            if self._path is not None:
                self._path.wait()
            self.writer.wait()
        # also when given back before: waiting for uploads (flush) attaches the uploader again
        self.spooled.close()  # uploads go on; the destination's lease is released after the last
        self._opened = False

    def _tell_budget_used_up(self) -> None:
        """At the start of training: when the session's time is already (nearly) used up, say so and
        from which clock it counts, before a training that stops at its first chance surprises."""
        # A checkpointer's own remaining_fn is the caller's clock: asked only at boundaries, where its
        # answer is acted on (a clock that counts its calls must not see an extra one here).
        if self._budget_told or self.trigger.on_deadline == "ignore" or self.config.remaining_fn is not None:
            return
        remaining = self.trigger.remaining()
        if remaining is None or remaining > self.trigger.margin:
            return
        self._budget_told = True
        self.warn(self._budget_words(remaining), key="budget-used-up")

    def _budget_words(self, remaining: float) -> str:
        """Why the session's time is up: the session module's account (the budget, its clock), or,
        with the checkpointer's own ``remaining_fn``, what it answered."""
        line = _session.budget_used_up() if self.config.remaining_fn is None else None
        if line:
            return line
        return (f"the session has {format_duration(max(0.0, remaining))} left, less than the "
                f"{format_duration(self.trigger.margin)} kept before its end: a training saves and stops at "
                "its first chance")

    def _committed(self, result: WriteResult) -> None:
        self.trigger.record_save(result.seconds)

    def check_storable(self, capture: Capture) -> None:
        """Raise now (at the start of training) if the state holds a value that cannot be stored,
        instead of at the first save an epoch later. Walks the tree; copies nothing."""
        from .state import encode  # layer 1; a cheap walk that only records tensor references

        encode(self.build_tree(capture))

    def build_tree(self, capture: Capture, rng_state: Optional[Dict[str, Any]] = None) -> StateTree:
        c = self.state.counters
        header: Header = {"format": STATE_FORMAT, "framework": self.framework}
        if self.epoch_batches:
            header["epoch_batches"] = int(self.epoch_batches)
        tree: StateTree = {"keepalive": header,
                           "counters": {"epoch": c.epoch, "step": c.step, "batch": c.batch, "samples": c.samples},
                           "extras": dict(self.extras)}
        tree.update(capture())
        if self.plan:
            tree["plan"] = dict(self.plan)
        tree["rng"] = rng.capture() if rng_state is None else rng_state
        return tree

    def save(self, capture: Capture, *, sync: bool = False, reason: str = "by hand",
             finished: bool = False, tree: Optional[StateTree] = None,
             check: Optional[Callable[[], Optional[str]]] = None) -> None:
        """Checkpoint now: the state is copied to host memory, the write goes on in the background.
        (``tree``: the state already built; ``check``: asked after the copy, names what changed
        meanwhile; then nothing is written: :class:`~keepalive.writer.SnapshotChanged`.)"""
        with self._lock:
            self._save(capture, sync=sync, reason=reason, finished=finished, tree=tree, check=check)

    def _save(self, capture: Capture, *, sync: bool, reason: str, finished: bool, tree: Optional[StateTree],
              check: Optional[Callable[[], Optional[str]]]) -> None:
        self._open()
        if reason != "by hand" and threading.current_thread() is threading.main_thread():
            # a loop in another cell than the one that made the checkpointer
            notebook.record_context(self.metadata, refresh=True)
        c = self.state.counters
        meta = dict(self.metadata, reason=reason, finished=finished, counters=c.as_dict())
        self.store.lease.progress = c.as_dict()
        log.info("saving step %d (epoch %d): %s", c.step, c.epoch, reason)
        self.steps_paused = True
        started = time.perf_counter()
        try:
            if tree is None:
                tree = self.build_tree(capture)
            self._tracked = _pauses.tensors_of(tree)
            if check is not None:
                self.writer.submit(tree, step=c.step, epoch=c.epoch, metadata=meta, sync=sync, check=check)
            else:
                self._settle_snapshot()  # the last lazy save's check, said here if it fails (not in submit's wait)
                defer = None if sync else self._deferrable()
                self._lazy_reason = reason if defer is not None else None
                self._lazy_step = c.step
                self.path.submit(tree, step=c.step, epoch=c.epoch, metadata=meta, sync=sync, defer=defer)
        finally:
            self.steps_paused = False
        if not sync:  # what the training waited for: the copy to host memory (a sync save waits for all)
            self.trigger.record_stall(time.perf_counter() - started)
        self._feed(bd.Saved())
        self.trigger.saved()

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait for the in-flight write (bounded by ``timeout`` seconds when given), then for the
        spooled checkpoints' uploads (bounded by ``timeout`` or ``flush_timeout``)."""
        self._settle_snapshot()
        if self._path is not None:
            self._path.wait(timeout)
        self.writer.wait(timeout)
        self.spooled.flush(timeout, end_of_run=self.finished or self.stopped)
        if not self._in_loop:  # the training loop is over (ended, stopped, left): the run is free
            self._give_back_lease()
            self._raise_stop()

    # ------------------------------------------------------------------------------ lifecycle
    # An adapter calls these at its framework's boundaries. Counters mean the same for every
    # adapter: ``epoch`` = epochs completed, ``batch`` = batches done in the running epoch,
    # ``step`` = optimizer steps, ``samples`` = samples seen.
    def new_fit(self, keep_counters: bool = False) -> None:
        """A new training call with the same checkpointer (Keras' ``fit`` run again): counters and
        end states start over (``keep_counters``: a further stage of the same run, the counters go on)."""
        self._feed(bd.NewFit(keep_counters))
        self.trigger.deadline_hit = False
        self._stop_to_raise = None

    @property
    def trained_here(self) -> List[Dict[str, Any]]:
        """The plans of the fits this process trained to their end on this run, in order (whatever
        checkpointer trained them): one callback per ``fit`` on the same path is the next stage."""
        return [dict(p) for p in _TRAINED_HERE.get(self.url, [])]

    def fit_trained(self, plan: Optional[Mapping[str, Any]] = None, objects: Iterable[Any] = ()) -> None:
        """The adapter's fit (stage) ran to its end in this process (trained, or found complete);
        ``objects``: what it trained (weakly referenced), for :meth:`trained_in_a_fit_here`."""
        _TRAINED_HERE.setdefault(self.url, []).append(dict(plan if plan is not None else self.plan))
        _TRAINED_OBJECTS.setdefault(self.url, weakref.WeakSet()).update(objects)

    def trained_in_a_fit_here(self, obj: Any) -> bool:
        """Whether ``obj`` was trained by a fit of this run that ran to its end in this process."""
        return obj in _TRAINED_OBJECTS.get(self.url, ())

    def start_epoch(self) -> None:
        """An epoch begins (for the trigger's epoch timing and the deadline prediction)."""
        self.trigger.start_epoch()

    def advance(self, capture: Capture, *, steps: Optional[int] = None, batch: Optional[int] = None,
                samples: int = 0, can_save: bool = True, pending: bool = False,
                requested: bool = False, length: Optional[int] = None) -> Decision:
        """After a training batch: count it, then act as due (:class:`keepalive.boundary.BatchEnd`).
        ``steps``: its optimizer steps when the framework counts them (default: the watched
        optimizers' steps since the last boundary; one where none is watched); ``can_save=False``:
        the loop cannot be resumed inside an epoch; ``pending``: gradients are being accumulated;
        ``length``: the batches of this epoch's pass, when the framework knows it (ranks with
        different numbers of batches are then told at the first boundary, not by a hang)."""
        with self._lock:
            decision = self._advance(capture, steps=steps, batch=batch, samples=samples, can_save=can_save,
                                     pending=pending, requested=requested, length=length)
            self._remember(capture, consistent=can_save and not pending)
            return decision

    def _advance(self, capture: Capture, *, steps: Optional[int], batch: Optional[int], samples: int,
                 can_save: bool, pending: bool, requested: bool, length: Optional[int]) -> Decision:
        self._before_boundary(capture)
        n = int(steps if steps is not None else self.state.counted_steps if self.watched else 1)
        consistent = can_save and not pending
        self.state, event = bd.count(self.state, bd.BatchEnd(
            steps=n, batch=batch, samples=int(samples), positionable=can_save, grads_pending=pending,
            requested=requested))
        event = bd.evolve(event, last=self._last_batch())
        due = self.trigger.after_step(n, consistent=consistent)  # sees the counters moved
        decision = self._feed(bd.evolve(event, due=due | self._take_owed()))
        if consistent:
            c = self.state.counters
            decision = self._agree(decision, _distributed.Position(_distributed.BATCH_END, c.epoch, c.batch,
                                                                   int(length or 0)))
        return self._carry_out(decision, capture)

    def end_epoch(self, capture: Capture, *, last: bool = False, epoch: Optional[int] = None,
                  requested: bool = False, count: bool = True) -> Decision:
        """An epoch ended (``epoch``: the number of epochs now complete, when the framework says):
        count it, then save / stop as due (``last``: the training's end, always saved; ``requested``:
        the user asked for a save after this epoch's batches; ``count=False``: the training ended
        without an epoch end, e.g. stopped by another callback)."""
        with self._lock:
            decision = self._end_epoch(capture, last=last, epoch=epoch, requested=requested, count=count)
            self._remember(capture, consistent=not last)
            return decision

    def _end_epoch(self, capture: Capture, *, last: bool, epoch: Optional[int], requested: bool,
                   count: bool) -> Decision:
        self._before_boundary(capture)
        steps = self.state.counted_steps
        if count and self.state.counters.batch > 0:
            self.epoch_batches = self.state.counters.batch  # this epoch's length, in the batch counter
        self.state, event = bd.count(self.state, bd.EpochEnd(epoch=epoch, last=last, requested=requested,
                                                             count=count))
        due = self.trigger.after_step(steps) if steps else bd.Due()  # see the counters moved
        due = due | self.trigger.after_epoch() | self._take_owed()
        decision = self._feed(bd.evolve(event, due=due))
        if not last:
            c = self.state.counters
            decision = self._agree(decision, _distributed.Position(_distributed.EPOCH_END, c.epoch, c.batch))
        if self.training_progress is not None:
            self.training_progress.epoch_end(last)
        return self._carry_out(decision, capture)

    def _last_batch(self) -> bool:
        """Whether the batch just counted is, as far as the core can tell, the training's last: the
        last planned epoch has reached the length of the epochs before it. A guess that is wrong
        only delays a scheduled save to the next boundary."""
        c, total = self.state.counters, self.total_epochs
        return bool(total and self.epoch_batches and c.epoch + 1 >= total and c.batch >= self.epoch_batches)

    def count_epoch(self) -> None:
        """An epoch ended whose boundary is acted on later (fastai saves a fit's last epoch in
        :meth:`end_stage`, after the other callbacks' end of fit): count it now, nothing else."""
        self._feed(bd.EpochCounted())

    def already_complete(self, total: Optional[int] = None, detail: str = "",
                         message: Optional[str] = None) -> None:
        """The checkpoint is at (or past) the end of the training asked for: say so (even with
        ``quiet=True``: a training call that trains nothing must say why), mark finished."""
        of = f" of {total}" if total else ""
        if _distributed.GROUP.is_main:  # every rank finds the same: said once
            report.say(message or f"run '{self.store.run}' already completed {self.state.counters.epoch} "
                       f"epoch(s){of}; nothing to do{detail}")
        self._feed(bd.Finish(True))
        self._give_back_lease()  # nothing to train: another session may open the run

    def end_stage(self, capture: Capture, *, reason: str, epoch_end: bool = True,
                  finished: bool = False) -> Decision:
        """A boundary after which training may go on in another stage (fastai's ``fine_tune`` runs two
        fits, each ending in the framework's own end-of-fit code): save now and wait until the write
        is durable, even when this step was saved before (code that ran since may have changed the
        state). With ``epoch_end`` the boundary also counts as the stage's last epoch end for the
        trigger (timing, deadline: the next stage may not fit in the session) and the progress bar.
        Then acts on a deadline stop and on a pending interrupt as any boundary does. The run is
        marked finished only when ``finished`` is given."""
        self._drain_signals()
        due = bd.Due()
        if epoch_end:
            due = bd.Due(stop=self.trigger.after_epoch().stop)
            if self.training_progress is not None:
                self.training_progress.epoch_end(True)
        return self._carry_out(self._feed(bd.StageEnd(reason=reason, finished=finished, due=due)), capture)

    # ----------------------------------------------------------------------------- boundaries
    def active(self, capture: Optional[Capture] = None) -> None:
        """A batch ran that is no boundary (a validation pass): the run is alive, not idle. What
        cannot wait for the next step boundary (a signal, a preemption notice, the deadline) is saved
        here when the state is still that of the last step (:mod:`keepalive.pauses`)."""
        self._settle_snapshot()
        self._alive()
        if self._mark is not None and not _distributed.GROUP.active and (
                capture is not None or not self.state.unsaved):
            # (under a process group a save is a collective the ranks would not all join here: the
            # next boundary, which every rank reaches, saves it)
            with self._lock:
                self._pause_save(capture, in_thread=False)

    def _alive(self) -> None:
        self._last_call = time.monotonic()
        self.store.lease.progress = self.state.counters.as_dict()
        _session.note_activity()

    # -------------------------------------------------------------------- saves between steps
    def pause_point(self, capture: Capture) -> None:
        """The state after the boundary just made is consistent for a save during the pause that
        follows, although the boundary itself could not save (Keras: an epoch's last batch, before
        fit's validation): the mark a save between steps starts from."""
        with self._lock:
            self._remember(capture, consistent=True)

    def _remember(self, capture: Capture, consistent: bool) -> None:
        """After a boundary: the mark a save between steps starts from (none after an inconsistent
        one: gradients are pending, the loader is ahead)."""
        self._last_call = time.monotonic()
        self._last_capture = capture
        if not consistent or self.state.finished or self.state.stopped:
            self._mark = None
            return
        self._mark = _pauses.Mark(counters=self.state.counters, rng=rng.capture(),
                                  optimizer_steps=self.optimizer_steps,
                                  versions=_pauses.version_sum(self._tracked),
                                  fingerprint=self.fingerprint() if self.fingerprint is not None else None,
                                  at=self._last_call)

    # --------------------------------------------------------------------------- lazy snapshots
    def _deferrable(self) -> Optional[Callable[[Any], bool]]:
        """Which tensors of a save the writer may copy after the loop went on: the parameters and
        state of the optimizers whose steps wait at the step gate (they change only inside a step,
        and the step settles the copy first). None: copy everything now."""
        if self.config.snapshot != "lazy" or not self.writer.background:
            return None
        optimizers = self.step_gate.watched()
        if not optimizers and not self.lazy_sources:
            return None
        deferred: Set[Tuple[int, int]] = set()

        def add(t: Any) -> None:
            if hasattr(t, "data_ptr") and hasattr(t, "_version"):
                deferred.add((t.data_ptr(), t.numel() * t.element_size()))

        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    add(p)
            for per_param in opt.state.values():
                for value in per_param.values():
                    add(value)
        for source in self.lazy_sources:
            for t in source():
                add(t)
        at_once = self._copy_at_once

        def defer(ref: Any) -> bool:
            return ref.key not in at_once and (ref.value.data_ptr(), ref.nbytes) in deferred

        return defer

    def settle_snapshot(self) -> None:
        """Before the deferred tensors of a lazy snapshot may change (an optimizer step: torch
        optimizers' step pre-hook calls this; an adapter whose framework steps otherwise calls it
        itself, from the training thread): wait for their copy and check it. A tensor changed in
        place before its copy drops the write; it is said once, the tensor is copied at once from
        now on, and the save is made again at the next boundary."""
        self._settle_snapshot()

    def _settle_snapshot(self) -> None:
        if not self.writer.unsettled:
            return
        changed = self.writer.settle()
        if not changed:
            return
        self._copy_at_once.update(changed)
        names = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        self.warn(f"{names} changed in place before its snapshot was copied: copied synchronously from now on, and "
                  f"the save of step {self._lazy_step} is made again at the next step boundary (a save copies "
                  "parameters and optimizer state in the background until the next optimizer step; nothing to "
                  "change, or snapshot='blocking' to copy everything at once)",
                  key="lazy-copy-changed")
        self._owed = self._owed | bd.Due(save=self._lazy_reason or "a save made again")

    def _take_owed(self) -> bd.Due:
        owed, self._owed = self._owed, bd.Due()
        return owed

    def _wake_guard(self) -> None:
        if self._guard is not None:
            self._guard.wake()

    def _guard_act(self) -> None:
        """The guard's thread, while the loop has not called keepalive for a while."""
        if self.writer.unsettled and self._lock.acquire(blocking=False):
            # a lazy snapshot's write waits for its check: with no step able to start, the loop's
            # pause is as good a moment as its next step
            try:
                with self.step_gate.closed() as between_steps:
                    if between_steps:
                        self._settle_snapshot()
            finally:
                self._lock.release()
        capture = self._last_capture
        if (self._mark is None or (capture is None and self.state.unsaved) or not self.step_gate.used
                or _distributed.GROUP.active or not self._lock.acquire(blocking=False)):
            return
        try:
            with self.step_gate.closed() as between_steps:
                if between_steps:
                    self._pause_save(capture, in_thread=True)
        finally:
            self._lock.release()

    def _pause_save(self, capture: Optional[Capture], in_thread: bool) -> None:
        """Save now what cannot wait for the next boundary, if the state is still the mark's."""
        signum = self.signals.peek()
        if signum is None:  # one taken at a boundary that could not save it
            signum = self.state.pending.signal
        due = bd.Due()
        if signum is None:
            due = self.trigger.between_steps_due(slack=_pauses.POLL_SECONDS + _pauses.PAUSE_SECONDS)
            if due.save is None and due.stop is None:
                return
        reason = f"{signal_name(signum)} received" if signum is not None else (due.stop or due.save or "")
        problem, stepping = self._unchanged_since_mark()
        tree: Optional[StateTree] = None
        mark = self._mark
        assert mark is not None
        if problem is None and self.state.unsaved:
            if capture is None:
                return
            tree = self.build_tree(capture, rng_state=mark.rng)
            problem = self._tree_problem(tree, mark)
        if problem is not None:
            self._owed = self._owed | due  # the next boundary saves it (a signal stays queued)
            if not stepping:  # a step under way is no pause: its boundary comes soon, nothing to say
                self._tell_refusal(reason, problem)
            return
        if tree is not None and capture is not None:
            check = (lambda: self._tree_problem(tree, mark)) if in_thread else None
            try:
                self.save(capture, sync=True, reason=f"{reason} (during a pause of the training loop)",
                          tree=tree, check=check)
            except SnapshotChanged as exc:
                self._owed = self._owed | due
                log.debug("the state changed while it was copied: %s", exc)
                return
        self._after_pause_save(signum, due, in_thread)

    def _unchanged_since_mark(self) -> Tuple[Optional[str], bool]:
        """What moved since the mark (None: nothing), and whether a training step is under way."""
        mark = self._mark
        if mark is None:
            return "no step ended yet", True
        if self.optimizer_steps != mark.optimizer_steps or self.state.counters != mark.counters:
            return "an optimizer step ran since the last step boundary", True
        if self.fingerprint is not None and mark.fingerprint is not None:
            objects, where = self.fingerprint()
            if where != mark.fingerprint[1]:
                return "the next batch is under way", True
            if objects != mark.fingerprint[0]:
                return "the loop changed state beside the tensors since its last step (e.g. a scheduler stepped)", False
        return None, False

    def _tree_problem(self, tree: StateTree, mark: _pauses.Mark) -> Optional[str]:
        """What changed in ``tree``'s tensors since ``mark`` (a forward's BatchNorm statistics, an EMA
        updated in place), or None."""
        if _pauses.version_sum(_pauses.tensors_of(tree)) != mark.versions:
            return "a tensor of the state was changed in place since the last step (a forward pass in "\
                   "training mode, an EMA update)"
        if self.fingerprint is not None and self.fingerprint() != mark.fingerprint:
            return "the loop changed its state while it was copied"
        return None

    def _tell_refusal(self, reason: str, problem: str) -> None:
        if self._refusal_told:
            return
        self._refusal_told = True
        self.warn(f"{reason.split(' -> ')[0]} while the training loop paused between steps (an evaluation?), but "
                  f"its state is no longer that of its last step ({problem}): the save waits for the next step "
                  f"boundary. {self.pause_hint}", key="pause-refused")

    def _after_pause_save(self, signum: Optional[int], due: bd.Due, in_thread: bool) -> None:
        where = position(self.state.counters.as_dict())
        self._mark = None if signum is not None else self._mark
        if signum is not None:
            self.say(f"{signal_name(signum)}: saved {where} to {self.url} during a pause of the training loop"
                     f"{_exit_words(signum)}")
            self._give_back_lease()
            if in_thread:
                # the signal is still queued: the handler, run again in the main thread, acts at once
                # (a real signal, so that a sleep or a wait in the main thread ends now)
                signal.pthread_kill(threading.main_thread().ident or 0, signum)
                return
            self.signals.take()
            self._forget_signal()
            self.uninstall_signal_handlers()
            raise_for(signum)
        self._flush_for_notice()
        if due.stop is not None:
            self._feed(bd.Deadline(due.stop))  # the loop stops at its next boundary (nothing new to save)
            self.say(f"saved {where} to {self.url} during a pause of the training loop; the training stops at its "
                     f"next step. Why: {self._stop_words(due.stop)}.")
        else:
            self.say(f"saved {where} to {self.url} during a pause of the training loop ({due.save})")

    def _notice_in(self, reason: str) -> Optional[_cloud.Notice]:
        """The cloud's notice a decision's ``reason`` comes from, if it does."""
        notice = self.trigger.notice_hit
        if notice is None or not reason.startswith(notice.detail):
            return None
        return notice  # type: ignore[return-value]

    def _flush_for_notice(self) -> None:
        """After a save a cloud's notice asked for: the uploads within the time the notice leaves,
        then the notice is acknowledged (Azure lets the VM go early)."""
        notice = self.trigger.notice_hit
        if notice is None:
            return
        left = notice.seconds_left()
        self.spooled.flush(max(1.0, left - 2.0) if left is not None else None, end_of_run=False)
        watcher = _cloud.watcher()
        if watcher is not None and notice.kind != "rebalance" and self.trigger.on_preempt == "save_and_stop":
            watcher.acknowledge(notice)  # type: ignore[arg-type]

    def _before_boundary(self, capture: Capture) -> None:
        # (no settling of a lazy snapshot here: gradient accumulation's micro-batches have boundaries
        # too, and the copy may run until the optimizer step itself)
        self._alive()  # a boundary acts on what is due itself (not as a pause)
        if not self._reserved:  # the first boundary prepares the first save's host buffer
            self._reserved = True
            try:
                tree = self.build_tree(capture)
                self._tracked = _pauses.tensors_of(tree)
                self.path.reserve(tree)
            except Exception as exc:  # noqa: BLE001 - an optimisation only; the save will say more
                log.debug("could not reserve the snapshot buffer: %s", exc)
        self._drain_signals()

    def _drain_signals(self) -> None:
        signum = self.signals.take()
        while signum is not None:
            self._feed(bd.Signal(signum))
            signum = self.signals.take()

    def _agree(self, decision: Decision, position: _distributed.Position) -> Decision:
        """At a consistent boundary of several processes: every rank's decision combined (and every
        rank at the same ``position``, else each raises the same line)."""
        agreement = self.path.agree(decision.save, decision.stop,
                                    decision.signal if decision.signal_note == "saved" else None, position)
        if agreement is not None:  # None: one process
            self.state, decision = bd.agreed(self.state, decision, save=agreement.save, stop=agreement.stop,
                                             signal=agreement.signal)
        return decision

    def _carry_out(self, decision: Decision, capture: Capture) -> Decision:
        c = self.state.counters
        news = self.trigger.take_news()
        if news:
            self.say(news)
        if decision.signal is not None and decision.signal_note == "unsaveable":
            self.uninstall_signal_handlers()
            self.warn(f"{signal_name(decision.signal)}: this loop cannot be saved inside an epoch "
                      f"({self.mid_epoch_obstacle or 'see the earlier warning'}); stopping without a new "
                      f"checkpoint: a restart continues from the last one (epoch {c.epoch} begins again)")
            raise_for(decision.signal)
        if decision.save:
            self.save(capture, sync=decision.sync, reason=decision.reason, finished=decision.finished)
        elif decision.flush:
            self.flush()
        where = position(c.as_dict())
        if decision.signal is not None:
            self.uninstall_signal_handlers()
            self._give_back_lease()  # the save above is durable (sync); the process stops or idles
            had = "training had finished; " if decision.signal_note == "finished" else ""
            self.say(f"{signal_name(decision.signal)}: {had}saved {where} to {self.url}{_exit_words(decision.signal)}")
            raise_for(decision.signal)
        notice = self._notice_in(decision.reason)
        if notice is not None and (decision.save or decision.flush):
            self._flush_for_notice()
        if decision.stop and notice is not None:
            self.say(f"stopping before the VM is reclaimed: saved {where} to {self.url}. Why: {notice.detail}. "
                     "On a new VM run the same code again (or %resume_training) to continue from here; "
                     "on_preempt='save' saves and trains on instead.")
            if _session.in_notebook():
                self._stop_to_raise = (f"training stopped: {notice.detail}; saved {where} to {self.url}. The cells "
                                       "after this one did not run. Run the same code again on a new VM to continue.")
        elif notice is not None and decision.save:
            self.say(f"{notice.detail}: saved {where} to {self.url}; the training goes on")
        elif decision.stop:
            why = self._stop_words(decision.reason)
            self.say(f"stopping before the session ends: saved {where} to {self.url}. Why: {why}. In a new "
                     "session run the same code again (or %resume_training) to continue from here.")
            if _session.in_notebook():
                # "Run all" must not go on into the cells that use the model as if it were trained:
                # the end of the training call raises, after the save is durable
                self._stop_to_raise = (
                    f"training stopped before the session ends ({self._stop_words(decision.reason, short=True)}); "
                    f"saved {where} to {self.url}. The "
                    "cells after this one did not run. In a new session run the same code again (or "
                    "%resume_training) to continue; on_deadline='save' saves and trains on instead.")
        if decision.finished or decision.stop:
            self._give_back_lease()  # the training is over (the save is durable: sync)
        return decision

    def _stop_words(self, reason: str, short: bool = False) -> str:
        """Why the training stops, in words: the deadline's arithmetic, or, when the session's time
        is used up, its budget and the clock it counts from (only named when the warning at the start
        of training said it all). ``short``: the first clause only."""
        why = reason[len("deadline: "):] if reason.startswith("deadline: ") else reason
        remaining = self.trigger.remaining()
        if remaining is not None and remaining <= 0:
            if short or self._budget_told:
                return "the session's time is already used up" + ("" if short else " (said at the start of training)")
            why = self._budget_words(remaining)
        return (why.split(";")[0] if short else why).rstrip(".")

    def _raise_stop(self) -> None:
        """In a notebook, end the training call with :class:`TrainingStopped` after a stop (once)."""
        message, self._stop_to_raise = self._stop_to_raise, None
        if message is not None:
            raise TrainingStopped(message)

    # -------------------------------------------------------------------------------- signals
    def install_signal_handlers(self) -> None:
        """Defer SIGINT and SIGTERM to the next consistent boundary (:mod:`keepalive.interrupts`)."""
        self.signals.install()
        self._in_loop = True  # also off the main thread, where no handler can be installed
        if self._guard is None:
            self._guard = _pauses.PauseGuard(lambda: self._last_call, self._guard_act)

    def uninstall_signal_handlers(self) -> None:
        self.signals.uninstall()
        self._in_loop = False
        if self._guard is not None:
            self._guard.stop()
            self._guard = None
        self._mark = None

    def _forget_signal(self) -> None:
        self.state = bd.evolve(self.state, pending=bd.evolve(self.state.pending, signal=None))

    # ---------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Finish the in-flight write and release the writer lease. In a notebook, after a stop before
        the session's deadline, then raises :class:`~keepalive.errors.TrainingStopped` (once)."""
        self._close()
        self._raise_stop()

    def _close(self) -> None:
        try:
            self.flush()
        finally:
            self.uninstall_signal_handlers()
            if self._progress:
                self._progress.close()
            self.spooled.close()
            if self._path is not None:
                self._path.close()
            self._opened = False


def _cloud_notice() -> Optional[_cloud.Notice]:
    """The cloud's newest preemption notice (None off a cloud VM: nothing is watched there)."""
    watcher = _cloud.watcher()
    return watcher.notice() if watcher is not None else None


def _exit_words(signum: int) -> str:
    """Why the process ends with a failure code after a save on SIGTERM (torchrun reports it): the
    program did not run to its end, and a failure is what makes a supervisor start it again."""
    if signum == signal.SIGINT:
        return ""
    return (f"; exiting with code {128 + signum} (stopped by {signal_name(signum)}), not 0: the program did "
            "not run to its end, and only a failed exit makes torchrun --max-restarts or a job scheduler start "
            "it again, which resumes from this checkpoint")


@atexit.register
def _flush_all_at_exit() -> None:
    for ckpt in list(_ACTIVE):
        try:
            ckpt._stop_to_raise = None  # exiting: nothing left to stop
            ckpt._close()
        except Exception as exc:  # noqa: BLE001 - exiting anyway
            log.error("could not finish the last checkpoint of %s: %s", ckpt.url, exc)


__all__ = ["Checkpointer", "Decision", "active_checkpointers", "default_dir", "resolve_run_url"]
