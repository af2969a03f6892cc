"""The framework-neutral checkpointer every adapter is built on.

An adapter says where the boundaries are (:meth:`Checkpointer.advance` after a batch,
:meth:`Checkpointer.end_epoch`, :meth:`Checkpointer.end_stage`; optimizer steps through
:meth:`Checkpointer.optimizer_stepped`), captures its objects' state as a tree and restores one
(:mod:`keepalive.adapter`: the contract). :class:`Checkpointer` is the facade an adapter talks to;
everything else lives below it: what a boundary does (save, stop, re-raise a signal) is decided by
the pure state machine of :mod:`keepalive.boundary`, fed the schedule's answer
(:mod:`keepalive.trigger`), and carried out by the parts of :mod:`keepalive.lifecycle` (the boundary
driver, the save, lazy snapshots, saves between steps, resume, stops, messages); a checkpoint leaves
the process by the save path of :mod:`keepalive.savepath` (one writer, gathered to rank 0, or in
pieces through DCP), chosen once when the run is first used; resume with fallback
(:mod:`keepalive.runs`), RNG capture (:mod:`keepalive.rng`), deferred interrupts
(:mod:`keepalive.interrupts`).

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
import weakref
from typing import Any, Callable, Dict, Iterable, List, Mapping, MutableMapping, Optional, Tuple, Union

from . import boundary as bd
from . import distributed as _distributed
from . import errors, notebook, report, rng
from . import pauses as _pauses
from . import progress as _progress
from .config import CheckpointConfig
from .interrupts import DeferredSignals
from .lifecycle import Capture, resuming
from .lifecycle.between_steps import BetweenSteps
from .lifecycle.boundaries import BoundaryDriver, BoundaryMachine
from .lifecycle.events import RunEvents, install_crash_hook
from .lifecycle.heartbeat import Heartbeat
from .lifecycle.messages import Messages
from .lifecycle.notifications import notify_events
from .lifecycle.saving import ALIVE, Saver
from .lifecycle.snapshots import LazySnapshots
from .lifecycle.stops import Stops, cloud_notice
from .notebook import default_dir, resolve_run_url
from .savepath import SavePath, open_destination
from .statetree import StateTree
from .store import CheckpointInfo, WriteResult
from .trigger import SaveTrigger

log = logging.getLogger("keepalive")

Decision = bd.Decision

#: per run URL, the plans of the fits (stages) this process trained to their end, in order: a new
#: callback on the path of a fit this process just finished starts the next stage, not a resume
_TRAINED_HERE: Dict[str, List[Dict[str, Any]]] = {}
#: per run URL, the objects (a model, a learner) those fits trained: the same object fit again is a
#: further stage, one built anew (a script or cell run again) a resume
_TRAINED_OBJECTS: Dict[str, "weakref.WeakSet[Any]"] = {}


def active_checkpointers() -> List["Checkpointer"]:
    """The checkpointers alive in this process (the magics use it to find the run a cell trained)."""
    return list(ALIVE)


class Checkpointer:
    """Where, when and how a training run is checkpointed and resumed (see module docstring).

    ``Checkpointer(path, every=..., keep=..., ...)`` or ``Checkpointer(config=CheckpointConfig(...))``:
    the options are those of :class:`keepalive.config.CheckpointConfig`. The work is done by its
    parts (:mod:`keepalive.lifecycle`): ``machine`` and ``boundaries`` (the boundary driver),
    ``saver`` (what happens at a save), ``snapshots`` (lazy copies), ``between_steps`` (the pause
    guard), ``stops`` and ``messages``.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]", None] = None, *,
                 config: Optional[CheckpointConfig] = None, framework: str = "generic",
                 **options: Any):
        cfg = CheckpointConfig.strict(path, config, options, "Checkpointer")
        self.config = cfg
        self.url = resolve_run_url(cfg.path, cfg.run, say=lambda line: report.say(
            line, quiet=cfg.quiet or not _distributed.GROUP.is_main))
        self.trigger = SaveTrigger(cfg.every, on_deadline=cfg.on_deadline, margin=cfg.deadline_margin,
                                   remaining_fn=cfg.remaining_fn, on_preempt=cfg.on_preempt,
                                   notice_fn=cloud_notice)
        #: the run folder's store, what the writer commits through (the store itself, or a local spool
        #: whose checkpoints a background thread uploads: keepalive/spool) and the writer
        where = open_destination(self.url, cfg, remaining_fn=self.trigger.remaining,
                                 on_durable=self.trigger.record_save)
        self.store, self.spooled, self.writer = where.store, where.spooled, where.writer
        self.saver = Saver(self)
        #: called with each WriteResult after a checkpoint is committed, whatever the save path
        self.on_commit: List[Callable[[WriteResult], None]] = self.writer.on_commit
        self.on_commit.append(self.saver.committed)
        #: the run's events for listeners (notifications, the heartbeat): :mod:`keepalive.lifecycle.events`
        self.events = RunEvents(self)
        self.on_commit.append(self.events.saved)
        self.heartbeat = Heartbeat.subscribed(self)  # the session's record in the run folder: keepalive.runlog
        self.notifications = notify_events(self)  # notify= / KEEPALIVE_NOTIFY: the events sent through Apprise
        install_crash_hook()
        self.framework = framework
        self.takeover = cfg.takeover
        self.quiet = cfg.quiet
        #: the boundary state machine (:mod:`keepalive.boundary`) and the parts that act on it
        self.machine = BoundaryMachine()
        self.boundaries = BoundaryDriver(self)
        self.messages = Messages(self)
        self.stops = Stops(self)
        self.snapshots = LazySnapshots(self)
        self.between_steps = BetweenSteps(self, lambda capture, in_thread: self._pause_save(capture, in_thread))
        self.counters: MutableMapping[str, int] = bd.CounterView(lambda: self.machine.state.counters,
                                                                 self.machine.feed)
        self.signals = DeferredSignals(lambda: self.machine.state.pending.signal, self.machine.forget_signal,
                                       announce=lambda: not _distributed.GROUP.active,
                                       noted=self.between_steps.wake)
        self._set_adapter_defaults(framework)
        #: closed by the guard while it copies the state; optimizer steps wait at it (torch adapters)
        self.step_gate = _pauses.StepGate()
        if cfg.snapshot not in ("lazy", "blocking"):
            raise ValueError(f"snapshot={cfg.snapshot!r}: use 'lazy' (the default) or 'blocking'")
        self.step_gate.before_step = weakref.WeakMethod(self.snapshots.settle)
        notebook.record_context(self.metadata)  # the notebook cell, or the script, that made the run
        ALIVE.add(self)  # the save's registry: a new one on a run takes the lease over from one whose loop is over

    def _set_adapter_defaults(self, framework: str) -> None:
        """The attributes an adapter reads or sets (what it knows of its loop), before it does."""
        self.extras: Dict[str, Any] = {}
        #: the newest value of each metric the training logged (``log``; what an adapter sees logged)
        self.last_metrics: Dict[str, float] = {}
        self.metadata: Dict[str, Any] = {"framework": framework}
        self.resumed_from: Optional[CheckpointInfo] = None
        #: how far the session that wrote the run before got (its lease's counters), when it resumed
        self.last_writer_progress: Optional[Dict[str, Any]] = None
        #: what the training code asks for (:mod:`keepalive.plan`), set by the adapter; saved with
        #: every checkpoint; ``saved_plan`` is the loaded checkpoint's (None: a new run, or an older one)
        self.plan: Dict[str, Any] = {}
        self.saved_plan: Optional[Dict[str, Any]] = None
        #: the training's settings as the code set them, flat (``{"optimizer.lr": 0.001}``), from the adapter,
        #: which records them in ``metadata["settings"]``: a finished unnamed run that recorded others is
        #: another training (:mod:`keepalive.runidentity`); None from it: nothing to compare
        self.training_settings: Optional[Callable[[], Optional[Dict[str, Any]]]] = None
        #: instead, for an adapter of several fits (Keras, fastai): what this fit sets otherwise than every
        #: fit a finished run recorded (``runidentity.differs_from_every_fit``), in words
        self.settings_differ: Optional[Callable[[Optional[Mapping[str, Any]]], List[str]]] = None
        #: objects whose state DCP saves in pieces, one per rank (set by the torch adapter before use)
        self.dcp_objects: Any = None
        #: the adapter's cheap summary of what it captures beside tensors, as a pair: (the objects'
        #: state, e.g. a scheduler's step count; the loop's position, e.g. batches handed out). A save
        #: between steps is made only while both are what they were at the last boundary; a moved
        #: position means a training step is under way (no pause: the next boundary saves)
        self.fingerprint: Optional[Callable[[], Tuple[Any, Any]]] = None
        #: more tensors a save may copy after the loop went on (an adapter's, whose framework changes
        #: them only in an optimizer step and calls :meth:`settle_snapshot` before it)
        self.lazy_sources: List[Callable[[], Iterable[Any]]] = []
        #: what to change so that a save during a pause is possible (the adapter knows its framework)
        self.pause_hint = ("To have it saved at once during an evaluation, step an epoch's scheduler (or update an "
                           "EMA) after the evaluation, not between the training batches and it")
        #: why the adapter's loop cannot be saved inside an epoch (said when an interrupt comes)
        self.mid_epoch_obstacle: Optional[str] = None
        #: the training loop runs (signal handlers installed): a checkpointer out of its loop hands
        #: the lease over to a new one on its run
        self.in_loop = False
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

    # ------------------------------------------------------------------------- state machine
    @property
    def state(self) -> bd.BoundaryState:
        """The boundary state machine's state (:mod:`keepalive.boundary`): changed only by its events."""
        return self.machine.state

    @property
    def finished(self) -> bool:
        return self.state.finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self.machine.feed(bd.Finish(bool(value)))

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
        return self.saver.path

    @property
    def loaded_url(self) -> str:
        """The checkpoint this run resumed from, else the run's folder: what a line refusing a
        checkpoint names."""
        return self.resumed_from.url if self.resumed_from is not None else self.url

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
            self.machine.feed(bd.OptimizerStep(index))

    # ------------------------------------------------------------------------------- messages
    def say(self, message: str) -> None:
        """News for the user, silenced by ``quiet=True``; said by the process that writes only."""
        self.messages.say(message)

    def warn(self, message: str, key: Optional[str] = None, own: bool = False) -> None:
        """A problem the user must see (not silenced by ``quiet``); once per ``key`` and run. Under a
        process group every rank runs the same code and finds the same problems: rank 0 says them,
        the others only log them. ``own``: a problem of this rank alone (its view of the run folder,
        its data), said by this rank, named."""
        self.messages.warn(message, key=key, own=own)

    # --------------------------------------------------------------------------------- resume
    def load(self, describe: Optional[Callable[[StateTree], str]] = None,
             check: Optional[Callable[[StateTree], None]] = None) -> Optional[StateTree]:
        """The newest valid checkpoint's state tree (falling back past corrupt ones), or None.
        ``check(tree)`` runs first and may raise (e.g. ``StateMismatchError``): then nothing changes,
        and ``load`` after fixing the objects tries again. Otherwise sets the counters and extras and
        says in one line what is resumed, with ``describe(tree)``'s words (e.g. what is restored)."""
        try:
            return resuming.load(self, describe, check)
        except errors.StorageError as exc:  # the destination cannot be used: its message says it all
            errors.in_one_line(exc)
            raise

    def restore_rng(self, tree: Mapping[str, Any]) -> None:
        if tree.get("rng"):
            rng.restore(tree["rng"])

    # ----------------------------------------------------------------------------------- save
    def check_storable(self, capture: Capture) -> None:
        """Raise now (at the start of training) if the state holds a value that cannot be stored,
        instead of at the first save an epoch later. Walks the tree; copies nothing."""
        from .state import encode  # layer 1; a cheap walk that only records tensor references

        encode(self.build_tree(capture))

    def build_tree(self, capture: Capture, rng_state: Optional[Dict[str, Any]] = None) -> StateTree:
        """The state tree a checkpoint holds (module docstring): ``capture()``'s objects and data, the
        counters, extras and plan, and the random state (``rng_state``, or that of now)."""
        return self.saver.build_tree(capture, rng_state)

    def save(self, capture: Capture, *, sync: bool = False, reason: str = "by hand",
             finished: bool = False, tree: Optional[StateTree] = None,
             check: Optional[Callable[[], Optional[str]]] = None) -> None:
        """Checkpoint now: the state is copied to host memory, the write goes on in the background.
        (``tree``: the state already built; ``check``: asked after the copy, names what changed
        meanwhile; then nothing is written: :class:`~keepalive.writer.SnapshotChanged`.)"""
        with self.machine.lock:
            self.saver.save(capture, sync=sync, reason=reason, finished=finished, tree=tree, check=check)

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait for the in-flight write (bounded by ``timeout`` seconds when given), then for the
        spooled checkpoints' uploads (bounded by ``timeout`` or ``flush_timeout``)."""
        self.saver.flush(timeout)

    def settle_snapshot(self) -> None:
        """Before the deferred tensors of a lazy snapshot may change (an optimizer step: torch
        optimizers' step pre-hook calls this; an adapter whose framework steps otherwise calls it
        itself, from the training thread): wait for their copy and check it. A tensor changed in
        place before its copy drops the write; it is said once, the tensor is copied at once from
        now on, and the save is made again at the next boundary."""
        self.snapshots.settle()

    # ------------------------------------------------------------------------------ lifecycle
    # An adapter calls these at its framework's boundaries. Counters mean the same for every
    # adapter: ``epoch`` = epochs completed, ``batch`` = batches done in the running epoch,
    # ``step`` = optimizer steps, ``samples`` = samples seen.
    def new_fit(self, keep_counters: bool = False) -> None:
        """A new training call with the same checkpointer (Keras' ``fit`` run again): counters and
        end states start over (``keep_counters``: a further stage of the same run, the counters go on)."""
        self.machine.feed(bd.NewFit(keep_counters))
        self.trigger.deadline_hit = False
        self.stops.to_raise = None

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
        with self.machine.lock:
            decision = self.boundaries.batch_end(capture, steps=steps, batch=batch, samples=samples,
                                                 can_save=can_save, pending=pending, requested=requested,
                                                 length=length)
            self.between_steps.remember(capture, consistent=can_save and not pending)
        self.events.stepped()
        return decision

    def end_epoch(self, capture: Capture, *, last: bool = False, epoch: Optional[int] = None,
                  requested: bool = False, count: bool = True) -> Decision:
        """An epoch ended (``epoch``: the number of epochs now complete, when the framework says):
        count it, then save / stop as due (``last``: the training's end, always saved; ``requested``:
        the user asked for a save after this epoch's batches; ``count=False``: the training ended
        without an epoch end, e.g. stopped by another callback)."""
        with self.machine.lock:
            decision = self.boundaries.epoch_end(capture, last=last, epoch=epoch, requested=requested, count=count)
            self.between_steps.remember(capture, consistent=not last)
            return decision

    def count_epoch(self) -> None:
        """An epoch ended whose boundary is acted on later (fastai saves a fit's last epoch in
        :meth:`end_stage`, after the other callbacks' end of fit): count it now, nothing else."""
        self.machine.feed(bd.EpochCounted())

    def already_complete(self, total: Optional[int] = None, detail: str = "",
                         message: Optional[str] = None) -> None:
        """The checkpoint is at (or past) the end of the training asked for: say so (even with
        ``quiet=True``: a training call that trains nothing must say why), mark finished."""
        of = f" of {total}" if total else ""
        if _distributed.GROUP.is_main:  # every rank finds the same: said once
            report.say(message or f"run '{self.store.run}' already completed {self.state.counters.epoch} "
                       f"epoch(s){of}; nothing to do{detail}")
        self.machine.feed(bd.Finish(True))
        self.saver.give_back_lease()  # nothing to train: another session may open the run
        self.events.ended("finished", "already complete")

    def end_stage(self, capture: Capture, *, reason: str, epoch_end: bool = True,
                  finished: bool = False) -> Decision:
        """A boundary after which training may go on in another stage (fastai's ``fine_tune`` runs two
        fits, each ending in the framework's own end-of-fit code): save now and wait until the write
        is durable, even when this step was saved before (code that ran since may have changed the
        state). With ``epoch_end`` the boundary also counts as the stage's last epoch end for the
        trigger (timing, deadline: the next stage may not fit in the session) and the progress bar.
        Then acts on a deadline stop and on a pending interrupt as any boundary does. The run is
        marked finished only when ``finished`` is given."""
        return self.boundaries.stage_end(capture, reason=reason, epoch_end=epoch_end, finished=finished)

    # ------------------------------------------------------------------- saves between steps
    def active(self, capture: Optional[Capture] = None) -> None:
        """A batch ran that is no boundary (a validation pass): the run is alive, not idle. What
        cannot wait for the next step boundary (a signal, a preemption notice, the deadline) is saved
        here when the state is still that of the last step (:mod:`keepalive.pauses`)."""
        self.snapshots.settle()
        self.between_steps.alive()
        if self.between_steps.mark is not None and not _distributed.GROUP.active and (
                capture is not None or not self.state.unsaved):
            # (under a process group a save is a collective the ranks would not all join here: the
            # next boundary, which every rank reaches, saves it)
            with self.machine.lock:
                self._pause_save(capture, in_thread=False)

    def pause_point(self, capture: Capture) -> None:
        """The state after the boundary just made is consistent for a save during the pause that
        follows, although the boundary itself could not save (Keras: an epoch's last batch, before
        fit's validation): the mark a save between steps starts from."""
        with self.machine.lock:
            self.between_steps.remember(capture, consistent=True)

    def _pause_save(self, capture: Optional[Capture], in_thread: bool) -> None:
        # the one entry of a save between steps, from the training thread and the guard's alike (a
        # test's negative control replaces it to have none)
        self.between_steps.save_now(capture, in_thread)

    # ------------------------------------------------------------------------ signals, close
    def install_signal_handlers(self) -> None:
        """Defer SIGINT and SIGTERM to the next consistent boundary (:mod:`keepalive.interrupts`)."""
        self.signals.install()
        self.in_loop = True  # also off the main thread, where no handler can be installed
        self.between_steps.start_guard()

    def uninstall_signal_handlers(self) -> None:
        self.signals.uninstall()
        self.in_loop = False
        self.between_steps.stop_guard()

    def close(self, *, raise_stop: bool = True) -> None:
        """Finish the in-flight write and release the writer lease. After a stop (the session's
        deadline, a notice), then raises it (once): :class:`~keepalive.errors.TrainingStopped` in a
        notebook, ``SystemExit(EXIT_STOPPED)`` in a script (:mod:`keepalive.lifecycle.stops`;
        ``raise_stop=False``: not, the training call being over: a handover, the interpreter's exit)."""
        if not raise_stop:
            self.stops.to_raise = None
        try:
            self.flush()
        finally:
            self.uninstall_signal_handlers()
            if self._progress:
                self._progress.close()
            self.saver.close()
            if self.events.running:  # an end no boundary told (a loop left early, a framework's own end)
                self.events.ended("finished" if self.finished else "stopped" if self.stopped else "closed",
                                  self.stop_reason or "")
        self.stops.raise_stop()


@atexit.register
def _flush_all_at_exit() -> None:
    for ckpt in list(ALIVE):
        try:
            ckpt.close(raise_stop=False)  # exiting: nothing left to stop
        except Exception as exc:  # noqa: BLE001 - exiting anyway
            log.error("could not finish the last checkpoint of %s: %s", ckpt.url, exc)


__all__ = ["Checkpointer", "Decision", "active_checkpointers", "default_dir", "resolve_run_url"]
