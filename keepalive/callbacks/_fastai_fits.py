"""Which fit of the run a fastai fit call is, and what it starts from (for the fastai ``DriveCheckpoint``).

A fit call is recognised by its notebook cell and its plan (:class:`._fastai_state.FitLog`, rules in
:mod:`keepalive.plan`). Against the run's newest checkpoint it is one of four: a fit that
completed before the restart (skipped whole), the fit whose end the checkpoint is (skipped, that end
state restored), the fit the checkpoint is in (resumed at its epoch and batch), or a fit new to the run
(it trains from the learner as it is, or from the checkpoint's end state). :class:`RunFits` decides
and says which; :class:`FitState` is what one counted fit call needs while it runs.

Why a module of its own: the decision is the one place where the run's record, the checkpoint and
this process' history meet; the callback's hooks only act on its answer.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from fastai.learner import Learner

from ..core import Checkpointer
from ..plan import change_words
from ..runidentity import by_fit, differs_from_every_fit
from ..statetree import Captured, StateTree
from . import _fastai_data as data
from . import _fastai_state as state

__all__ = ["At", "FitState", "RunFits", "ValidSplit", "plan_words"]


@dataclass
class FitState:
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
class At:
    """Where a boundary left the fit, as a checkpoint of it says: epochs done, batches done in the
    running one, the learner's training iterations and schedule position, and (at an epoch end,
    where a resume starts the next epoch's data from them) the loaders' RNGs."""

    epoch: int
    batch: int
    train_iter: int
    pct_train: float
    dl_rngs: Optional[List[Any]] = None


def plan_words(changed: Any) -> str:
    """A fit's plan changes in words (the schedule's fingerprint is no value to read)."""
    return change_words(changed, {"schedule": "another hyper-parameter schedule (lr_max, div, pct_start, ...)"})


class ValidSplit:
    """The validation split's fingerprint (:func:`._fastai_state.valid_split`, computed once per
    DataLoaders object), and the check that it is the checkpoint's."""

    def __init__(self) -> None:
        self._seen: Optional[Tuple[Any, Optional[str]]] = None  # (the DataLoaders, their split's fingerprint)

    def of(self, learn: Learner) -> Optional[str]:
        dls = getattr(learn, "dls", None)
        if self._seen is None or self._seen[0]() is not dls:
            try:
                ref: Any = weakref.ref(dls)
            except TypeError:
                ref = lambda: None  # noqa: E731 - not weak-referenceable: computed each time
            self._seen = (ref, state.valid_split(learn))
        return self._seen[1]

    @staticmethod
    def check(core: Checkpointer, tree: StateTree) -> None:
        """Say once when the validation split is not the checkpoint's (an unseeded random split)."""
        saved = (tree.get("plan") or {}).get("valid_split")
        now = core.plan.get("valid_split")
        if saved and now and saved != now:
            core.warn("the validation set differs from the one before the restart (a random split made "
                      "again in this process, e.g. RandomSplitter() without a seed): training goes on, "
                      "but on other training samples and with metrics on another validation set than the "
                      "uninterrupted run's. Give the splitter a seed (RandomSplitter(seed=42), "
                      "TabularPandas(splits=RandomSplitter(seed=42)(...))) so that every session splits "
                      "the same way.", key="fastai-valid-split")


class RunFits:
    """The run's fits as one callback knows them: the run's newest checkpoint (read at the first fit,
    or again after an interrupted one), its record of fits (:attr:`log`), and for each fit call which
    fit of the run it is."""

    def __init__(self) -> None:
        self.log = state.FitLog()
        self.tree: Optional[StateTree] = None  # loaded, not yet applied to a fit
        self.loaded = False  # the checkpoint (and with it the run's fits) is read at the next fit
        self.next_stage: Optional[int] = None  # the fit this process trained before (said at the next fit)

    def interrupted(self) -> None:
        """A fit was interrupted (Ctrl-C, an error): running the cell again starts over from its first
        fit, and resumes from the newest checkpoint as a new session would."""
        self.loaded, self.tree = False, None
        self.log.restart_cell()

    def load(self, core: Checkpointer, learn: Learner, here: state.RunHere) -> Optional[StateTree]:
        """The checkpoint this callback's fits start from (read once; None: a new run, or the next
        stage of a fit this process trained)."""
        if self.loaded:
            return self.tree
        core.new_fit()  # the first fit, or one run again after an interruption: from the checkpoint
        live = here.live if core.trained_here else None
        if live is not None:
            # A callback new to the run after a fit that this process trained on this learner (one
            # callback per fit call): the next stage, from the learner as it is (the newest
            # checkpoint is that fit's end, and the user may have changed the learner since, e.g.
            # unfreeze()); the run's fits and counters go on.
            self.log.load({"fits": live["fits"]})
            self.log.pass_all()
            for name, value in live["counters"].items():
                core.counters[name] = value
            self.next_stage = len(live["fits"])
            self.tree, self.loaded = None, True
            return None
        now = state.fit_settings(core.plan)  # a finished run is compared fit by fit (runidentity)
        core.settings_differ = lambda then: differs_from_every_fit(now, then)
        tree = core.load(describe=state.describe, check=lambda t: state.check_fits(
            learn, t, core.loaded_url))
        self.tree = tree
        self.log.load(tree["fastai"] if tree is not None else None)
        self.loaded = True
        return tree

    def place(self, core: Checkpointer, learn: Learner, here: state.RunHere, fit_id: Dict[str, Any],
              phase: Optional[int], tree: Optional[StateTree]) -> Optional[Tuple[int, Optional[StateTree]]]:
        """Which fit of the run the fit call ``fit_id`` is: its number and the checkpoint it resumes
        (None: it starts anew), or None when it is skipped (completed before the restart)."""
        pos = tree["fastai"]["position"] if tree is not None else None
        k = self._number(core, fit_id, pos, phase)
        if pos is not None and k is not None and k < pos["fit"]:
            core.say(f"fit {k}{state.phase_words(phase)} had completed before the restart (the checkpoint is "
                     f"in fit {pos['fit']}): skipped")
            here.live = None  # the learner is behind the run: a later fit loads the checkpoint
            core.fit_trained(fit_id["plan"])
            return None
        if pos is not None and pos["done"] and tree is not None:  # a fit's end: go on from that state
            self.tree = None
            self._restore_end(core, learn, tree)
            if k is not None:  # this very fit
                self._end_was_this_fit(core, here, k, pos, fit_id["plan"])
                return None
            self.log.pass_all()
            core.say(f"fit {len(self.log.entries) + 1}{state.phase_words(phase)} is new to run "
                     f"'{core.store.run}': it trains from the end of fit {pos['fit']}")
        elif tree is None and self.next_stage is not None:
            core.say(f"fit {len(self.log.entries) + 1}{state.phase_words(phase)} of run '{core.store.run}' is "
                     f"the next stage after fit {self.next_stage}, which this process trained: it trains from "
                     "the learner as it is")
        self.next_stage = None
        resume: Optional[StateTree] = None
        if pos is not None and k == pos["fit"]:
            resume, self.tree = tree, None
        if k is None:
            k = self.log.add(fit_id, phase)
        self.record_settings(core)
        return k, resume

    def record_settings(self, core: Checkpointer) -> None:
        """Each checkpoint records the settings of every fit of the run (compared with a re-run's)."""
        core.metadata["settings"] = {key: value for i, entry in enumerate(self.log.entries)
                                     for key, value in by_fit(i, state.fit_settings(entry.get("plan") or {})).items()}

    def _number(self, core: Checkpointer, fit_id: Dict[str, Any], pos: Optional[Dict[str, Any]],
                phase: Optional[int]) -> Optional[int]:
        """The run's number of the fit call (None: new to the run). A call the record does not hold,
        while the checkpoint is inside a fit, is taken as the fit at its place in the checkpoint's
        cell, else as the checkpoint's fit (said once)."""
        k = self.log.find(fit_id)  # its number in the run, if the run has seen it
        if pos is None or k is not None or pos["done"]:  # at a fit's end, new fits start from there
            return k
        k = self.log.find_like(fit_id, pos["fit"], phase)  # inside a fit (another cell)
        if k is not None:
            core.warn(f"this fit call is not recorded in run '{core.store.run}' (another cell, or the cell "
                      f"was edited): it is taken as fit {k}, at its place in the cell that wrote the "
                      "checkpoint", key="fastai-fit-like")
            return k
        self.log.pass_all()
        core.warn(f"this fit call is not recorded in run '{core.store.run}' (another cell, or the cell was "
                  f"edited): it continues fit {pos['fit']}, the one the checkpoint is in", key="fastai-unknown-fit")
        return pos["fit"]

    @staticmethod
    def _restore_end(core: Checkpointer, learn: Learner, tree: StateTree) -> None:
        """A fit's end state into the learner, outside any fit: what the next fit starts from."""
        state.restore(learn, tree)
        state.write_loggers(learn, tree["fastai"])
        data.set_dl_rngs(learn, tree["fastai"].get("dl_rngs"))
        core.restore_rng(tree)
        ValidSplit.check(core, tree)

    def _end_was_this_fit(self, core: Checkpointer, here: state.RunHere, k: int, pos: Dict[str, Any],
                          plan_now: Dict[str, Any]) -> None:
        """The checkpoint is this very fit's end: skipped, said (with its plan's changes, if any)."""
        core.finished = pos.get("phase") != 1
        words = state.phase_words(pos.get("phase"), state.epochs(pos["n_epoch"]))
        changed = state.plan_changes(self.log.plan_of(k), plan_now)
        if changed:
            core.warn(f"fit {k}{words} had completed before the restart; the code now asks another plan "
                      f"({plan_words(changed)}): the checkpoint wins, the fit is skipped and its "
                      "end state restored. To train the new plan, use another run (path or run=).",
                      key=f"fastai-plan-done-{k}")
        else:
            core.say(f"fit {k}{words} had completed before the restart: skipped, its end state "
                     "restored. To train again from here, use another run (path or run=).")
        here.live = {"fits": self.log.upto(k), "counters": dict(core.counters)}
        core.fit_trained(plan_now)
