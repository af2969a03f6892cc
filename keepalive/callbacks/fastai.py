"""``DriveCheckpoint`` for fastai: a ``Callback`` that makes re-running the same cell enough.

>>> learn.fit_one_cycle(20, 1e-3, cbs=DriveCheckpoint("/content/drive/MyDrive/runs/pets"))  # doctest: +SKIP
>>> learn.fine_tune(6, cbs=DriveCheckpoint("gs://bucket/runs/pets", every="10min"))        # doctest: +SKIP
>>> learn = vision_learner(dls, resnet34, cbs=DriveCheckpoint(path))                      # doctest: +SKIP

After a crash, a disconnect or the end of a session, run the same code again: training continues from
the newest valid checkpoint bit for bit as if never interrupted. Restored: model, optimizer, GradScaler,
Recorder, schedulers, tracker callbacks (:mod:`keepalive.callbacks._fastai_state`), the loaders' and the
global RNGs, and the position: fit call (``fine_tune`` makes two; ``lr_find`` is not counted), epoch,
batch, ``pct_train``. A fit call is recognised by its notebook cell (the source and the fit's number in
that cell execution; outside a notebook by its number among the learner's fits on the run in the
process) and by its plan (epochs, schedule: :class:`._fastai_state.FitLog`), so after a restart the
setup cell and the training cell alone are enough (``%resume_training``). Fits completed before the
restart are skipped whole (no callback sees them; one whose end is the checkpoint has that end state
restored), the fit the checkpoint is in resumes at its epoch and batch (under the code's plan when it
changed: said once), a fit the run has not seen starts from the checkpoint. A fit after one that this
process trained on the same learner is the next stage, whether its callback is the same object or a
new one on the same path: it trains from the learner as it is (:class:`._fastai_state.RunHere`). Every
fit's end is saved after the other callbacks' ``after_fit``. ``CSVLogger`` files are saved with the
state and rewritten at a resume; a validation split other than the checkpoint's is said once. Positions
in messages are counts of work done ("1 of 3 epochs done").

Transparent: the loaders are iterated as fastai iterates them (same order, same worker seeds); with the
callback and no interruption a training is bit-identical to the same one without it
(``tests/test_fastai_data.py``). A mid-epoch resume replays the loader's own randomness: the random
states the epoch began with, the first batches' indices passed over without loading, the saved step's
random state, and the random states workers started the next batches from
(:mod:`keepalive.callbacks._fastai_data`).

Limits: inside an epoch (``every`` = steps or a duration, Ctrl-C, SIGTERM, the deadline) a checkpoint is
taken only where the training loader can be positioned (fastai's ``DataLoader`` / ``TfmdDL``, and the
tabular and text defaults ``TabWeightedDL`` and ``SortedDL``; another order method: epoch ends only, with
a warning) and no ``GradientAccumulation`` is pending; ``train_metrics``
accumulators are not restored mid-epoch; tracker files live under ``learn.path`` (keep it on Drive).
Near the session's time limit the fit is saved and cancelled (``cb.stopped``), and ends with the stop (a
script's ``SystemExit(143)``, a notebook's ``TrainingStopped``; a later fit of a caller that caught it is
skipped). A checkpoint that does not fit the learner raises :class:`~keepalive.errors.StateMismatchError`
before anything changes. How: while attached, a wrapper stands in front of ``Learner._with_events`` on
that learner, so skipped fits and epochs reach no callback and saves run after every other callback.
Every fastai internal this relies on is listed in :mod:`keepalive.callbacks._compat_fastai` and checked
when the callback is created: a fastai version without one is refused then, in one line.

Parts: the event routing and boundaries are here; which fit of the run a fit call is,
:mod:`keepalive.callbacks._fastai_fits` (its plan rules: :mod:`keepalive.plan`); a checkpoint put into
the running fit, :mod:`keepalive.callbacks._fastai_resume`; what a checkpoint holds,
:mod:`keepalive.callbacks._fastai_capture`.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Callable, List, Optional, Tuple, Union

from fastai.callback.core import Callback, CancelFitException
from fastai.callback.schedule import LRFinder
from fastai.learner import Learner
from fastai.torch_core import find_bs
from fastcore.basics import noop

from .. import rng
from ..adapter import RunViews
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..statetree import Captured, StateTree
from . import _compat_fastai as fc
from . import _fastai_data as data
from . import _fastai_state as state
from ._fastai_capture import fit_tree
from ._fastai_fits import At, FitState, RunFits, ValidSplit
from ._fastai_resume import restore_in_fit, resume_epoch

__all__ = ["DriveCheckpoint"]

#: said when a save during the validation is refused because a callback changed the state before it
PAUSE_HINT = ("To have it saved at once during the validation, change the state (a learning rate, a weight, an "
              "EMA, the freeze state) in a callback's after_epoch or before_train, not in after_train or "
              "before_validate")


class _EventsHook:
    """Stands in for ``Learner._with_events`` on one learner while a DriveCheckpoint is attached."""

    def __init__(self, cb: "DriveCheckpoint", learn: Learner, previous: Any):
        self.cb, self.learn, self.previous = cb, learn, previous

    def call(self, f, event_type, ex, final=noop):
        if self.previous is not None:
            return self.previous(f, event_type, ex, final)
        return getattr(type(self.learn), fc.WITH_EVENTS)(self.learn, f, event_type, ex, final)

    def __call__(self, f, event_type, ex, final=noop):
        return self.cb._events(self.learn, self.call, f, event_type, ex, final)


class DriveCheckpoint(RunViews, Callback):  # RunViews: no epoch / step (a callback reads the learner's)
    """Checkpoint a fastai training to a local folder, a mounted Drive or any fsspec URL.

    Give it to a fit call (``cbs=``) or to the ``Learner``. Options: see
    :class:`keepalive.config.CheckpointConfig`. What is saved and restored, and when: see the module.
    ``cb.save()`` works while a fit runs (e.g. from another callback); ``cb.counters`` counts the run.
    """

    order = 95  # only before_train / before_batch work is done in callback events; saves run after all
    # not pickled (learn.export()): rebuilt
    _stateattrs = ("_core", "_fit", "_runfits", "_split")

    def __init__(self, path: Union[str, "os.PathLike[str]", None] = None, *,
                 config: Optional[CheckpointConfig] = None, **options: Any):
        fc.COMPAT.check()  # every fastai internal this adapter uses exists (else one line says which)
        super().__init__()
        self._config = CheckpointConfig.strict(path, config, options, "DriveCheckpoint")
        self._n_fits = 0             # fit calls this callback has counted (lr_find etc. are not)
        self._init_state()
        self.core  # noqa: B018 - create now: a bad path or every= fails here, not inside fit()

    def _init_state(self) -> None:
        super()._init_state()
        self._core: Optional[Checkpointer] = None
        self._fit: Optional[FitState] = None
        self._runfits = RunFits()  # the run's fits: which one each fit call is, what it starts from
        self._split = ValidSplit()  # the validation split's fingerprint (compared on resume)

    @property  # built on first use: learn.export() pickles the callback without it
    def core(self) -> Checkpointer:  # type: ignore[override]
        if self._core is None:
            self._core = Checkpointer(config=self._config, framework="fastai")
            self._core.fingerprint = self._fingerprint
            self._core.pause_hint = PAUSE_HINT
            # Lazy snapshots: fastai's Optimizer is no torch optimizer (no step hooks), and a training
            # batch holds the step gate from its start: the copy of its parameters and state runs on
            # through the next batch's forward and backward, and is settled at its 'step' event
            # (_events), before any callback's before_step (MixedPrecision's GradScaler) or the step
            self._core.step_gate.settle_at_step_start = False
            self._core.lazy_sources.append(_optimizer_tensors_of(self))
        return self._core

    def __repr__(self) -> str:
        return f"DriveCheckpoint({self.core.url!r})"

    # ---------------------------------------------------------------------------- attach/detach
    @property
    def learn(self) -> Any:  # the Learner while attached, else None
        return self.__dict__.get("_learn")

    @learn.setter
    def learn(self, value: Optional[Learner]) -> None:
        old = self.__dict__.get("_learn")
        if old is value:
            return
        hook = old.__dict__.get(fc.WITH_EVENTS) if old is not None else None
        if isinstance(hook, _EventsHook) and hook.cb is self:  # detached: fastai's own one again
            if hook.previous is None:
                del old.__dict__[fc.WITH_EVENTS]
            else:
                old.__dict__[fc.WITH_EVENTS] = hook.previous
        self.__dict__["_learn"] = value
        if value is not None:
            if not callable(getattr(type(value), fc.WITH_EVENTS, None)):
                raise TypeError(f"keepalive's fastai DriveCheckpoint needs Learner._with_events (fastai "
                                f"2.x); {type(value).__name__} has none")
            value.__dict__[fc.WITH_EVENTS] = _EventsHook(self, value, value.__dict__.get(fc.WITH_EVENTS))

    # ---------------------------------------------------------------------------- event routing
    def _events(self, learn: Learner, call: Callable, f, event_type: str, ex, final) -> Any:
        if event_type == fc.FIT_EVENT:
            return self._run_fit(learn, call, f, ex, final)
        if event_type in (fc.STEP_EVENT, fc.VALIDATE_EVENT):
            # A lazy snapshot's background copy must be done and checked before: the step (the
            # optimizer's parameters and state change from here on; a before_step callback may step
            # them too), a validation (a callback may swap in averaged weights through .data, which
            # moves no version counter: an EMA evaluated in before_validate)
            self.core.settle_snapshot()
            if event_type == fc.STEP_EVENT:
                return call(f, event_type, ex, final)
        st = self._fit
        if st is None:
            return call(f, event_type, ex, final)
        if event_type == fc.EPOCH_EVENT:
            if learn.epoch < st.skip_until:
                return None  # finished before the restart: no event, nothing runs
            st.epoch_ended = False
            self.core.start_epoch()
            return call(_then_always(f, lambda: self._moved(st)), fc.EPOCH_EVENT, ex,
                        _then(lambda: self._epoch_end(learn, st), final))
        if event_type == fc.BATCH_EVENT and learn.training:
            # The pause guard's thread may copy the state only between training batches: a batch
            # waits at its start while it copies (fastai's own Optimizer has no torch step hooks)
            gate = self.core.step_gate
            self._moved(st)
            gate.enter_step()
            try:
                return call(f, fc.BATCH_EVENT, ex, _then(lambda: self._step_end(learn, st), final))
            finally:
                gate.leave_step()
        if event_type == fc.BATCH_EVENT:  # an evaluation's batch (validation, get_preds in a callback)
            return call(f, fc.BATCH_EVENT, ex, _then(lambda: self._paused(st), final))
        return call(f, event_type, ex, final)

    def _run_fit(self, learn: Learner, call: Callable, f, ex, final) -> Any:
        if self._fit is not None or any(isinstance(cb, LRFinder) for cb in learn.cbs):
            return call(f, fc.FIT_EVENT, ex, final)  # lr_find (restores the weights itself) or nested
        core = self.core
        if core.stopped:
            core.say("fit skipped: training stopped before the session's end. In a new session run the "
                     "same code again to continue.")
            return None
        here = state.run_here(core.url, learn)
        phase = state.fine_tune_phase(learn)
        plan_now = state.fit_plan(learn, phase)
        core.plan = dict(plan_now, valid_split=self._split.of(learn))
        tree = self._runfits.load(core, learn, here)
        if tree is not None:
            # fastai finds the batch layout lazily, fetching (and augmenting: RNG draws) one item the
            # first time it is asked, in the first batch of the run; a resumed process asks it now,
            # without a draw (the draws of that fetch are in the checkpoint's random state).
            # (an error is suppressed: fastai asks again, and reports it, at the first batch)
            with rng.unchanged(), contextlib.suppress(Exception):
                getattr(learn.dls, "n_inp", None)
        self._n_fits += 1
        placed = self._runfits.place(core, learn, here, self._runfits.log.next_id(here, plan_now), phase, tree)
        if placed is None:  # completed before the restart (or the checkpoint is its end): skipped
            return None
        k, resume = placed
        st = FitState(k, phase, plan=plan_now)
        self._fit = st

        def do_fit():  # runs after every callback's before_fit
            self._begin(learn, st, resume)
            f()

        try:
            return call(do_fit, fc.FIT_EVENT, ex, _then(lambda: self._fit_end(learn, st, here), final))
        finally:
            self._fit = None
            if st.positioned:
                data.uninstall(st.dl)
            try:
                if self._core is not None:
                    # waits for the write in flight, releases the writer lease; after a stop, raises it
                    self._core.close()
            finally:
                if not st.completed:
                    # Interrupted (Ctrl-C, an error, a stop): running the cell again starts over from
                    # its first fit, and resumes from the newest checkpoint as a new session would.
                    self._runfits.interrupted()
                    here.live = None

    def _begin(self, learn: Learner, st: FitState, resume: Optional[StateTree]) -> None:
        """Start of a counted fit, after every callback's before_fit: position data, restore state."""
        core = self.core
        st.begun = True
        dl = st.dl = learn.dls.train
        st.n_iter = len(dl)
        st.why_not = data.positionable(dl)
        st.positioned = st.why_not is None
        if st.positioned:
            data.install(dl)
        else:
            core.warn(f"{st.why_not}: checkpoints at epoch ends only (a save due inside an epoch waits for "
                      "its end)", key="fastai-positionable")
        core.trigger.mid_epoch, core.mid_epoch_obstacle = st.positioned, st.why_not
        if resume is not None:
            restore_in_fit(self.core, self._runfits.log, learn, st, resume)
            mbar = getattr(getattr(learn, "progress", None), "mbar", None)
            if st.skip_until and mbar is not None:  # fastprogress' bar must see 0 first; the skipped
                with contextlib.suppress(Exception):  # epochs never reach it (display only: never fatal)
                    mbar.update(0)
        core.total_epochs = core.counters["epoch"] - st.skip_until + learn.n_epoch
        core.check_storable(lambda: self._state_tree(learn, st, "epoch"))  # fails now, not at a save
        core.step_gate.used = True  # training batches hold the gate (_events): the guard may save between
        core.install_signal_handlers()

    def restore(self, tree: StateTree) -> None:
        """Put a loaded tree into the running fit: model, optimizer, schedule position, callbacks'
        states, Recorder, the DataLoaders' and global RNGs (inside an epoch: at its saved batch)."""
        st = self._fit
        if st is None or self.learn is None:
            raise RuntimeError("DriveCheckpoint.restore() works while a fit runs")
        restore_in_fit(self.core, self._runfits.log, self.learn, st, tree)

    def capture(self) -> Captured:
        """The running fit's state as at its last epoch end (as :meth:`save` writes it)."""
        st = self._fit
        if st is None or self.learn is None:
            raise RuntimeError("DriveCheckpoint.capture() works while a fit runs")
        return self._state_tree(self.learn, st, "epoch")

    # ------------------------------------------------------------------------- callback events
    def before_train(self) -> None:
        st = self._fit
        if st is None or not st.begun:
            return
        learn = self.learn
        mid = st.resume_mid
        if mid is not None and learn.epoch == mid["fastai"]["position"]["epoch"]:
            st.resume_mid = None
            st.epoch_start = resume_epoch(self.core, learn, st, mid)
            return
        st.epoch_start = data.epoch_start(learn, st.dl) if st.positioned else None

    def before_batch(self) -> None:
        st = self._fit
        if st is not None and st.iter_offset and self.learn.training:
            self.learn.iter += st.iter_offset

    def after_train(self) -> None:
        st = self._fit
        if st is None:
            return
        st.iter_offset = 0
        if st.positioned:
            data.rewind(st.dl)

    def before_validate(self) -> None:
        st = self._fit
        if st is not None and st.begun:
            self._paused(st)

    def after_cancel_train(self) -> None:
        # the epoch's training pass ended before its last batch: a save during the validation would
        # resume at the last batch done and train the batches this run skipped
        if self._fit is not None:
            self._moved(self._fit)

    def after_validate(self) -> None:
        st = self._fit
        if st is not None and st.begun and self.learn.epoch >= st.skip_until:
            st.epoch_ended = True
            self._paused(st)

    # ------------------------------------------------------------------------------- boundaries
    def _step_end(self, learn: Learner, st: FitState) -> None:
        ga = getattr(learn, "gradient_accumulation", None)  # partial gradients are not saved
        at = At(learn.epoch, learn.iter + 1, int(getattr(learn, "train_iter", 0)),
                 float(getattr(learn, "pct_train", 0.0)))
        st.capture = lambda: self._state_tree(learn, st, "step", at)
        decision = self.core.advance(st.capture, batch=learn.iter + 1,
                                     samples=find_bs(learn.yb) if len(learn.yb) else find_bs(learn.xb),
                                     can_save=st.positioned, pending=bool(getattr(ga, "count", 0)))
        if decision.stop:
            st.stopped = True
            raise CancelFitException()

    def _epoch_end(self, learn: Learner, st: FitState) -> None:
        self.core.heartbeat.log(recorded_values(learn))  # the Recorder's epoch row, into the session record
        st.epoch_ended = False
        st.epochs_done = learn.epoch + 1
        if learn.epoch + 1 >= learn.n_epoch:
            # the fit's end is saved in _fit_end, after the other callbacks' after_fit
            self.core.count_epoch()
            return
        at = At(learn.epoch + 1, 0, int(getattr(learn, "train_iter", 0)), float(getattr(learn, "pct_train", 0.0)),
                 data.dl_rngs(learn))
        st.capture = lambda: self._state_tree(learn, st, "epoch", at)
        if self.core.end_epoch(st.capture).stop:
            st.stopped = True
            raise CancelFitException()

    def _fit_end(self, learn: Learner, st: FitState, here: state.RunHere) -> None:
        st.completed = True  # the fit ended through fastai's own path (normally or cancelled)
        if not st.begun or st.stopped:
            return
        if st.epoch_ended:  # an after_epoch callback (EarlyStopping) ended the fit before _epoch_end
            self.core.count_epoch()
            st.epochs_done = learn.epoch + 1
        # A fit's end is the end of the training unless fine_tune's second fit follows.
        decision = self.core.end_stage(lambda: self._state_tree(learn, st, "fit"), finished=st.phase != 1,
                                       reason=f"end of fit {st.index}{state.phase_words(st.phase)}")
        st.stopped = st.stopped or decision.stop
        if not st.stopped:  # trained to its end here: a new callback on this run goes on from here
            here.live = {"fits": self._runfits.log.upto(st.index), "counters": dict(self.core.counters)}
            self.core.fit_trained(st.plan)

    # ------------------------------------------------------------------------ saves between steps
    @staticmethod
    def _moved(st: FitState) -> None:
        st.moves += 1

    def _paused(self, st: FitState) -> None:
        """The loop is between training steps (an evaluation): the core saves now what cannot wait
        (a signal, a preemption notice, the deadline) if nothing moved since the last boundary."""
        self.core.active(st.capture)

    def _fingerprint(self) -> Tuple[Any, Any]:
        """What the captures read beside tensors (optimizer hyper-parameters, the Recorder, trackers,
        the ParamScheduler's record, the loggers' files), and where the loop is: the fit, the epoch,
        the batches begun and epochs' work ended since (:attr:`._fastai_fits.FitState.moves`), the training
        iterations. Asked by the core at each boundary and before a save between steps. Not the epoch:
        the next epoch's prologue (before its first batch: workers starting, a slow first fetch) is a
        pause too, and the capture of an epoch end holds its position itself (:class:`._fastai_fits.At`)."""
        st, learn = self._fit, self.learn
        if st is None or learn is None:
            return None, None
        return state.summary(learn), (st.index, st.moves, getattr(learn, "train_iter", None))

    # ---------------------------------------------------------------------------------- capture
    def _state_tree(self, learn: Learner, st: FitState, kind: str, at: Optional[At] = None) -> Captured:
        """The running fit's checkpoint (:func:`._fastai_capture.fit_tree`)."""
        return fit_tree(self.core, self._runfits.log, learn, st, kind, at)

    def save(self, *, sync: bool = False) -> None:
        """Save now (only at an epoch boundary or inside a running fit's step boundary is it exact)."""
        if self._fit is None or self.learn is None:
            raise RuntimeError("DriveCheckpoint.save() works while a fit runs (e.g. from a callback)")
        self.core.save(self.capture, sync=sync, reason="by hand")


def _optimizer_tensors_of(cb: DriveCheckpoint) -> Callable[[], List[Any]]:
    """The core's lazy source for ``cb``'s learner (held weakly: the core is the callback's)."""
    ref = weakref.ref(cb)

    def tensors() -> List[Any]:
        target = ref()
        learn = target.learn if target is not None else None
        return state.optimizer_tensors(learn) if learn is not None else []

    return tensors


def _then_always(f: Callable[[], Any], after: Callable[[], Any]) -> Callable[[], None]:
    """``f()``, then ``after()`` however ``f`` ended (fastai's Cancel... exceptions included)."""
    def run() -> None:
        try:
            f()
        finally:
            after()
    return run


def _then(first: Callable[[], Any], final: Callable[[], Any]) -> Callable[[], None]:
    """For fastai's ``final`` argument: ``first()`` (a boundary of ours), then fastai's ``final()``."""
    def run() -> None:
        first()
        final()
    return run


def recorded_values(learn: Learner) -> dict:
    """The Recorder's newest epoch row by name (``train_loss``, ``valid_loss``, the metrics); empty
    without a Recorder or before its first epoch."""
    rec = getattr(learn, "recorder", None)
    if rec is None or not getattr(rec, "values", None):
        return {}
    return dict(zip(list(rec.metric_names)[1:], rec.values[-1]))
