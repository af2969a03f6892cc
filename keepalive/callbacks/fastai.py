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
Near the session's time limit the fit is saved and cancelled (``cb.stopped``; later fits of the cell are
skipped). A checkpoint that does not fit the learner raises :class:`~keepalive.errors.StateMismatchError`
before anything changes. How: while attached, a wrapper stands in front of ``Learner._with_events`` on
that learner, so skipped fits and epochs reach no callback and saves run after every other callback.
Every fastai internal this relies on is listed in :mod:`keepalive.callbacks._compat_fastai` and checked
when the callback is created: a fastai version without one is refused then, in one line.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from fastai.callback.core import Callback, CancelFitException
from fastai.callback.schedule import LRFinder
from fastai.learner import Learner
from fastai.torch_core import find_bs
from fastcore.basics import noop

from .. import rng
from ..adapter import RunViews
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..plan import describe as describe_plan
from ..statetree import Captured, StateTree
from . import _compat_fastai as fc
from . import _fastai_data as data
from . import _fastai_state as state

__all__ = ["DriveCheckpoint"]

FORMAT = 2  # 2: the run's fits are recorded ("fits"); 1 numbered them by process
#: said when a save during the validation is refused because a callback changed the state before it
PAUSE_HINT = ("To have it saved at once during the validation, change the state (a learning rate, a weight, an "
              "EMA, the freeze state) in a callback's after_epoch or before_train, not in after_train or "
              "before_validate")


@dataclass
class _FitState:
    """What one counted fit call needs while it runs."""

    index: int
    phase: Optional[int] = None    # 1 / 2: fine_tune's frozen / unfrozen fit; None: another fit
    begun: bool = False
    n_iter: int = 0
    skip_until: int = 0            # epochs below this are skipped (finished before the restart)
    resume_mid: Optional[StateTree] = None  # a mid-epoch checkpoint, applied at before_train
    iter_offset: int = 0
    dl: Any = None                 # the training loader of this fit
    positioned: bool = False       # it can start an epoch at any batch (mid-epoch saves possible)
    why_not: Optional[str] = None
    epoch_start: Optional[Dict[str, Any]] = None  # the RNGs as the running epoch's data began
    stopped: bool = False
    epoch_ended: bool = False      # the running epoch's work is done (after_validate reached)
    epochs_done: int = 0
    completed: bool = False        # the fit ended through fastai's own path (normally or cancelled)
    #: moves of the training loop away from its last boundary that no boundary counts yet: a training
    #: batch begun, an epoch's work (its validation included) ended. Part of the loop position the
    #: core compares before saving between steps: it changes before any callback of that batch or of
    #: after_epoch can change what a checkpoint holds
    moves: int = 0
    #: the capture of the last boundary, with its position fixed there (an evaluation's batches move
    #: learn.iter, the next epoch's prologue learn.epoch, pct_train and the loaders' RNGs): what a
    #: save between steps writes
    capture: Optional[Callable[[], Captured]] = None
    plan: Dict[str, Any] = field(default_factory=dict)  # what the code asks of it (_fastai_state.fit_plan)


@dataclass(frozen=True)
class _At:
    """Where a boundary left the fit, as a checkpoint of it says: epochs done, batches done in the
    running one, the learner's training iterations and schedule position, and (at an epoch end,
    where a resume starts the next epoch's data from them) the loaders' RNGs."""

    epoch: int
    batch: int
    train_iter: int
    pct_train: float
    dl_rngs: Optional[List[Any]] = None


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
    _stateattrs = ("_core", "_fit", "_tree", "_fits", "_loaded", "_split_seen", "_next_stage")

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
        self._fit: Optional[_FitState] = None
        self._tree: Optional[StateTree] = None  # loaded, not yet applied to a fit
        self._fits = state.FitLog()
        self._loaded = False  # the checkpoint (and with it the run's fits) is read at the next fit
        self._split_seen: Optional[Tuple[Any, Optional[str]]] = None  # (the DataLoaders, their split's fingerprint)
        self._next_stage: Optional[int] = None  # the fit this process trained before (said at the next fit)

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
        core.plan = dict(plan_now, valid_split=self._valid_split(learn))
        tree = self._load(learn, here)
        if tree is not None:
            # fastai finds the batch layout lazily, fetching (and augmenting: RNG draws) one item the
            # first time it is asked, in the first batch of the run; a resumed process asks it now,
            # without a draw (the draws of that fetch are in the checkpoint's random state).
            saved = rng.capture()
            with contextlib.suppress(Exception):  # fastai asks again (and reports) at the first batch
                getattr(learn.dls, "n_inp", None)
            rng.restore(saved)
        self._n_fits += 1
        fit_id = self._fits.next_id(here, plan_now)
        k = self._fits.find(fit_id)  # its number in the run, if the run has seen it
        pos = tree["fastai"]["position"] if tree is not None else None
        if pos is not None and k is None and not pos["done"]:  # inside a fit: at a fit's end, new fits
            k = self._fits.find_like(fit_id, pos["fit"], phase)  # start from there (another cell)
            if k is not None:
                core.warn(f"this fit call is not recorded in run '{core.store.run}' (another cell, or the cell "
                          f"was edited): it is taken as fit {k}, at its place in the cell that wrote the "
                          "checkpoint", key="fastai-fit-like")
        if pos is not None and k is None and not pos["done"]:
            k = pos["fit"]
            self._fits.pass_all()
            core.warn(f"this fit call is not recorded in run '{core.store.run}' (another cell, or the cell was "
                      f"edited): it continues fit {k}, the one the checkpoint is in", key="fastai-unknown-fit")
        if pos is not None and k is not None and k < pos["fit"]:
            core.say(f"fit {k}{state.phase_words(phase)} had completed before the restart (the checkpoint is "
                     f"in fit {pos['fit']}): skipped")
            here.live = None  # the learner is behind the run: a later fit loads the checkpoint
            core.fit_trained(plan_now)
            return None
        if pos is not None and pos["done"] and tree is not None:  # a fit's end: go on from that state
            self._tree = None
            state.restore(learn, tree)
            state.write_loggers(learn, tree["fastai"])
            data.set_dl_rngs(learn, tree["fastai"].get("dl_rngs"))
            core.restore_rng(tree)
            self._check_split(tree)
            if k is not None:  # this very fit
                core.finished = pos.get("phase") != 1
                words = state.phase_words(pos.get("phase"), state.epochs(pos["n_epoch"]))
                changed = state.plan_changes(self._fits.plan_of(k), plan_now)
                if changed:
                    core.warn(f"fit {k}{words} had completed before the restart; the code now asks another plan "
                              f"({self._plan_words(changed)}): the checkpoint wins, the fit is skipped and its "
                              "end state restored. To train the new plan, use another run (path or run=).",
                              key=f"fastai-plan-done-{k}")
                else:
                    core.say(f"fit {k}{words} had completed before the restart: skipped, its end state "
                             "restored. To train again from here, use another run (path or run=).")
                here.live = {"fits": self._fits.upto(k), "counters": dict(core.counters)}
                core.fit_trained(plan_now)
                return None
            self._fits.pass_all()
            core.say(f"fit {len(self._fits.entries) + 1}{state.phase_words(phase)} is new to run "
                     f"'{core.store.run}': it trains from the end of fit {pos['fit']}")
        elif tree is None and self._next_stage is not None:
            core.say(f"fit {len(self._fits.entries) + 1}{state.phase_words(phase)} of run '{core.store.run}' is "
                     f"the next stage after fit {self._next_stage}, which this process trained: it trains from "
                     "the learner as it is")
        self._next_stage = None
        resume: Optional[StateTree] = None
        if pos is not None and k == pos["fit"]:
            resume, self._tree = tree, None
        if k is None:
            k = self._fits.add(fit_id, phase)
        st = _FitState(k, phase, plan=plan_now)
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
            if self._core is not None:
                self._core.close()  # waits for the write in flight, releases the writer lease
            if not st.completed:
                # Interrupted (Ctrl-C, an error): running the cell again starts over from its first
                # fit, and resumes from the newest checkpoint as a new session would.
                self._loaded, self._tree = False, None
                self._fits.restart_cell()
                here.live = None

    # ------------------------------------------------------------------------------------ resume
    def _load(self, learn: Learner, here: state.RunHere) -> Optional[StateTree]:
        if self._loaded:
            return self._tree
        core = self.core
        core.new_fit()  # the first fit, or one run again after an interruption: from the checkpoint
        live = here.live if core.trained_here else None
        if live is not None:
            # A callback new to the run after a fit that this process trained on this learner (one
            # callback per fit call): the next stage, from the learner as it is (the newest
            # checkpoint is that fit's end, and the user may have changed the learner since, e.g.
            # unfreeze()); the run's fits and counters go on.
            self._fits.load({"fits": live["fits"]})
            self._fits.pass_all()
            for name, value in live["counters"].items():
                core.counters[name] = value
            self._next_stage = len(live["fits"])
            self._tree, self._loaded = None, True
            return None
        tree = core.load(describe=state.describe, check=lambda t: state.check_fits(
            learn, t, core.resumed_from.url if core.resumed_from else core.url))
        self._tree = tree
        self._fits.load(tree["fastai"] if tree is not None else None)
        self._loaded = True
        return tree

    def _valid_split(self, learn: Learner) -> Optional[str]:
        """The validation split's fingerprint (computed once per DataLoaders object)."""
        dls = getattr(learn, "dls", None)
        if self._split_seen is None or self._split_seen[0]() is not dls:
            try:
                ref: Any = weakref.ref(dls)
            except TypeError:
                ref = lambda: None  # noqa: E731 - not weak-referenceable: computed each time
            self._split_seen = (ref, state.valid_split(learn))
        return self._split_seen[1]

    def _check_split(self, tree: StateTree) -> None:
        """Say once when the validation split is not the checkpoint's (an unseeded random split)."""
        saved = (tree.get("plan") or {}).get("valid_split")
        now = self.core.plan.get("valid_split")
        if saved and now and saved != now:
            self.core.warn("the validation set differs from the one before the restart (a random split made "
                           "again in this process, e.g. RandomSplitter() without a seed): training goes on, "
                           "but on other training samples and with metrics on another validation set than the "
                           "uninterrupted run's. Give the splitter a seed (RandomSplitter(seed=42), "
                           "TabularPandas(splits=RandomSplitter(seed=42)(...))) so that every session splits "
                           "the same way.", key="fastai-valid-split")

    @staticmethod
    def _plan_words(changed: Any) -> str:
        """A fit's plan changes in words (the schedule's fingerprint is no value to read)."""
        words = []
        for key, was, now in changed:
            if key == "epochs":
                words.append(f"epochs {was} -> {now}")
            elif key == "schedule":
                words.append("another hyper-parameter schedule (lr_max, div, pct_start, ...)")
            else:
                words.append(describe_plan([(key, was, now)]))
        return ", ".join(words)

    def _begin(self, learn: Learner, st: _FitState, resume: Optional[StateTree]) -> None:
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
            self._restore_in_fit(learn, st, resume)
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
        self._restore_in_fit(self.learn, st, tree)

    def capture(self) -> Captured:
        """The running fit's state as at its last epoch end (as :meth:`save` writes it)."""
        st = self._fit
        if st is None or self.learn is None:
            raise RuntimeError("DriveCheckpoint.capture() works while a fit runs")
        return self._state_tree(self.learn, st, "epoch")

    def _restore_in_fit(self, learn: Learner, st: _FitState, tree: StateTree) -> None:
        fa = tree["fastai"]
        pos = fa["position"]
        if pos["batch"]:  # inside an epoch: this loader must start there exactly
            data.check_resumable(pos["n_iter"], st.n_iter, st.why_not)
        self._say_plan_changes(learn, st, tree)
        state.restore(learn, tree, warn=lambda msg, key: self.core.warn(msg, key=key))
        state.restore_loggers(learn, fa)
        self._check_split(tree)
        learn.train_iter = int(pos["train_iter"])
        st.skip_until = st.epochs_done = int(pos["epoch"])
        if pos["batch"]:
            st.resume_mid = tree
        else:
            data.set_dl_rngs(learn, fa.get("dl_rngs"))
            self.core.restore_rng(tree)
        where = state.where_words(pos["epoch"], learn.n_epoch, pos["batch"], pos["n_iter"])
        self.core.say(f"fit {st.index}{state.phase_words(st.phase)} continues: {where}")

    def _say_plan_changes(self, learn: Learner, st: _FitState, tree: StateTree) -> None:
        """The resumed fit's plan is not the checkpoint's: the code's wins (fastai runs the fit's
        epochs and schedule as the code gives them; the position is the work done), said once."""
        pos = tree["fastai"]["position"]
        saved = self._fits.plan_of(st.index) or dict(tree.get("plan") or {}) or {"epochs": pos["n_epoch"]}
        changed = state.plan_changes(saved, st.plan)
        self._fits.replan(st.index, st.plan)
        if not changed:
            return
        was = int(saved.get("epochs", pos["n_epoch"]))
        where = state.where_words(min(pos["epoch"], learn.n_epoch), learn.n_epoch, pos["batch"], pos["n_iter"])
        if pos["epoch"] >= learn.n_epoch:
            outcome = f"{state.epochs(pos['epoch'])} are done, so the fit ends here"
        else:
            outcome = f"the fit goes on from {where} with the code's schedule at that point"
        self.core.warn(f"fit {st.index}{state.phase_words(st.phase)} was planned otherwise before the restart "
                       f"({self._plan_words(changed)}): the code's plan wins, {outcome}. To finish the saved "
                       f"plan instead, run the fit as before the restart ({state.epochs(was)}, the same "
                       "learning rates); to train the new plan from the start, use another run (path or run=).",
                       key=f"fastai-plan-{st.index}")

    # ------------------------------------------------------------------------- callback events
    def before_train(self) -> None:
        st = self._fit
        if st is None or not st.begun:
            return
        learn = self.learn
        mid = st.resume_mid
        if mid is not None and learn.epoch == mid["fastai"]["position"]["epoch"]:
            st.resume_mid, pos = None, mid["fastai"]["position"]
            # the schedule's position: as saved, or (the code changed the fit's epochs) the same work
            # done placed on the code's epochs
            learn.pct_train = (float(pos["pct_train"]) if pos["n_epoch"] == learn.n_epoch
                               else int(pos["train_iter"]) / (st.n_iter * learn.n_epoch))
            st.iter_offset = int(pos["batch"])
            start = mid["fastai"]["epoch_start"]
            workers = mid["fastai"].get("workers")
            if "rng" not in start and st.dl.fake_l.num_workers > 0:
                self.core.warn("this checkpoint was written by an older keepalive, which seeded DataLoader workers "
                               "per batch: the resumed epoch has the saved order, but its random draws differ "
                               "from the uninterrupted run's", key="fastai-old-epoch-start")
            if workers and int(start.get("workers", st.dl.fake_l.num_workers)) != st.dl.fake_l.num_workers:
                self.core.warn(f"the checkpoint was written with {start['workers']} DataLoader workers, this "
                               f"training has {st.dl.fake_l.num_workers}: the rest of the resumed epoch's "
                               "augmentation in workers differs from the uninterrupted run's (the order is "
                               "the same)", key="fastai-workers-changed")
            st.epoch_start = data.resume_epoch(learn, st.dl, start, st.iter_offset, workers,
                                               lambda: self.core.restore_rng(mid))
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
    def _step_end(self, learn: Learner, st: _FitState) -> None:
        ga = getattr(learn, "gradient_accumulation", None)  # partial gradients are not saved
        at = _At(learn.epoch, learn.iter + 1, int(getattr(learn, "train_iter", 0)),
                 float(getattr(learn, "pct_train", 0.0)))
        st.capture = lambda: self._state_tree(learn, st, "step", at)
        decision = self.core.advance(st.capture, batch=learn.iter + 1,
                                     samples=find_bs(learn.yb) if len(learn.yb) else find_bs(learn.xb),
                                     can_save=st.positioned, pending=bool(getattr(ga, "count", 0)))
        if decision.stop:
            st.stopped = True
            raise CancelFitException()

    def _epoch_end(self, learn: Learner, st: _FitState) -> None:
        st.epoch_ended = False
        st.epochs_done = learn.epoch + 1
        if learn.epoch + 1 >= learn.n_epoch:
            # the fit's end is saved in _fit_end, after the other callbacks' after_fit
            self.core.count_epoch()
            return
        at = _At(learn.epoch + 1, 0, int(getattr(learn, "train_iter", 0)), float(getattr(learn, "pct_train", 0.0)),
                 data.dl_rngs(learn))
        st.capture = lambda: self._state_tree(learn, st, "epoch", at)
        if self.core.end_epoch(st.capture).stop:
            st.stopped = True
            raise CancelFitException()

    def _fit_end(self, learn: Learner, st: _FitState, here: state.RunHere) -> None:
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
            here.live = {"fits": self._fits.upto(st.index), "counters": dict(self.core.counters)}
            self.core.fit_trained(st.plan)

    # ------------------------------------------------------------------------ saves between steps
    @staticmethod
    def _moved(st: _FitState) -> None:
        st.moves += 1

    def _paused(self, st: _FitState) -> None:
        """The loop is between training steps (an evaluation): the core saves now what cannot wait
        (a signal, a preemption notice, the deadline) if nothing moved since the last boundary."""
        self.core.active(st.capture)

    def _fingerprint(self) -> Tuple[Any, Any]:
        """What the captures read beside tensors (optimizer hyper-parameters, the Recorder, trackers,
        the ParamScheduler's record, the loggers' files), and where the loop is: the fit, the epoch,
        the batches begun and epochs' work ended since (:attr:`_FitState.moves`), the training
        iterations. Asked by the core at each boundary and before a save between steps. Not the epoch:
        the next epoch's prologue (before its first batch: workers starting, a slow first fetch) is a
        pause too, and the capture of an epoch end holds its position itself (:class:`_At`)."""
        st, learn = self._fit, self.learn
        if st is None or learn is None:
            return None, None
        return state.summary(learn), (st.index, st.moves, getattr(learn, "train_iter", None))

    # ---------------------------------------------------------------------------------- capture
    def _state_tree(self, learn: Learner, st: _FitState, kind: str, at: Optional[_At] = None) -> Captured:
        """``at``: where the boundary the capture was made for left the fit (else read from the learner)."""
        objects = state.capture_objects(learn)
        train_iter, pct_train = int(getattr(learn, "train_iter", 0)), float(getattr(learn, "pct_train", 0.0))
        if at is not None:
            epoch, batch, train_iter, pct_train = at.epoch, at.batch, at.train_iter, at.pct_train
        elif kind == "step":
            epoch, batch = learn.epoch, learn.iter + 1
        elif kind == "epoch":
            epoch, batch = learn.epoch + 1, 0
        else:
            epoch, batch = st.epochs_done, 0
        fa: Dict[str, Any] = {
            "format": FORMAT,
            "fits": self._fits.upto(st.index),
            "position": {"fit": st.index, "phase": st.phase, "done": kind == "fit", "epoch": epoch,
                         "batch": batch, "n_epoch": int(learn.n_epoch), "n_iter": st.n_iter,
                         "train_iter": train_iter, "pct_train": pct_train},
            **state.capture_callbacks(learn),
        }
        if at is not None and at.dl_rngs is not None:
            fa["dl_rngs"] = at.dl_rngs
        if kind == "step":
            fa["epoch_start"] = st.epoch_start
            workers = data.worker_states(st.dl, batch, st.n_iter)
            if workers is None:
                self.core.warn("a DataLoader worker did not start the batches after this checkpoint's in "
                               f"{data.STATE_WAIT_S:.0f} s: a resume from it replays the order, but not the "
                               "random draws (augmentation) in workers", key="fastai-worker-states")
            elif workers:
                fa["workers"] = workers
        return {"objects": objects, "fastai": fa}

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
