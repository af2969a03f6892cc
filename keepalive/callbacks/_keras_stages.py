"""Which fit of a run a Keras ``fit`` is (its stage), and where it begins (for the Keras ``DriveCheckpoint``).

Several fits (transfer learning: freeze, fit, unfreeze, recompile, fit) are stages of one run. A fit
of a model that completed a fit on this run in this process is its next stage, from the state in
memory; a model built anew resumes the run, each fit matched with the checkpoint's stages by its
position and its plan (:mod:`keepalive.plan`). The checkpoint records the stage it is in
(``keras.stage``) and the completed ones before it (``keras.stages``: their epochs, plan, History).

Why a module of its own: the adapter's hooks ask three questions here ("which checkpoint does this fit
start from?", "which stage is it?", "what does a changed plan mean?") and act on the answers; the
bookkeeping of the model's fits in this process and the words for each case live here.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..core import Checkpointer
from ..plan import Resumed, by_plan, changes, describe
from ..runidentity import by_fit, differs_from_every_fit
from ..statetree import StateTree
from . import _keras_state as kstate

__all__ = ["ModelFits", "Stages", "code_plan", "fit_settings", "fits_of"]


@dataclass
class ModelFits:
    """What this process knows of one model's fits on one run, whichever callback object ran them
    (one per ``fit`` or one for all)."""

    next: int = 0  # the stage the model's next fit is
    done: List[Dict[str, Any]] = field(default_factory=list)  # completed stages: {"epochs", "plan", "history"}
    loaded: bool = False  # the run's newest checkpoint was read; False: the next fit reads it (again)
    tree: Optional[StateTree] = None  # that checkpoint, when it belongs to a later fit than the one that read it
    reader: Optional[Checkpointer] = None  # the checkpointer that read it (another one reads it again)
    counters: Optional[Dict[str, int]] = None  # where the last completed fit ended: the next one goes on
    optimizer: Any = None  # a weak reference to the optimizer the last completed fit trained with


#: per model, per run URL: a model that completed a fit here continues the run with its next fit (a new
#: stage); a model built anew (the script or cell run again) resumes the run from its checkpoint
_FITS: "weakref.WeakKeyDictionary[Any, Dict[str, ModelFits]]" = weakref.WeakKeyDictionary()


def fits_of(model: Any, url: str) -> ModelFits:
    """This process' record of ``model``'s fits on the run at ``url``."""
    return _FITS.setdefault(model, {}).setdefault(url, ModelFits())


def code_plan(model: Any, epochs: int, fits: ModelFits) -> Dict[str, Any]:
    """What this fit's code asks for (:mod:`keepalive.plan`), read before anything is restored: the
    epochs, and the optimizer's class and learning rate when the optimizer is new to this model's
    fits here (compiled for this fit; one that goes on from the last fit carries its rate, which
    ReduceLROnPlateau may have lowered, and is no part of the code's plan)."""
    found: Dict[str, Any] = {"epochs": epochs}
    optimizer = model.optimizer
    if optimizer is not None and (fits.optimizer is None or fits.optimizer() is not optimizer):
        found["optimizer"] = type(optimizer).__name__
        rate = kstate.learning_rate_plan(optimizer)
        if isinstance(rate, dict):  # a schedule: one plan value per setting (each change named)
            found.update({f"optimizer.learning_rate.{key}": value for key, value in rate.items()})
        else:
            found["optimizer.learning_rate"] = rate
    return found


def fit_settings(model: Any) -> Dict[str, Any]:
    """The optimizer settings this fit's code set, flat (``{"optimizer": "Adam",
    "optimizer.learning_rate": 0.001, "optimizer.beta_1": 0.9, ...}``): recorded per fit with each
    checkpoint, and compared with a finished unnamed run's (:mod:`keepalive.runidentity`)."""
    optimizer = model.optimizer
    if optimizer is None:
        return {}
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer: the one it wraps
    found: Dict[str, Any] = {"optimizer": type(inner).__name__}
    rate = kstate.learning_rate_plan(optimizer)
    if isinstance(rate, dict):
        found.update({f"optimizer.learning_rate.{key}": value for key, value in rate.items()})
    else:
        found["optimizer.learning_rate"] = rate
    try:
        config = inner.get_config()
    except Exception:  # noqa: BLE001 - an optimizer without a config: its class and rate
        config = {}
    for key, value in config.items():
        if key not in ("name", "learning_rate") and isinstance(value, (bool, int, float, str)):
            found[f"optimizer.{key}"] = value
    return found


class Stages:
    """The stage of the run the running ``fit`` is, and where it began (``base``: the run's counters
    then). One per callback; ``fits`` is the model's record, set at each fit's start."""

    def __init__(self, core: Checkpointer) -> None:
        self.core = core
        self.index = 0  # this fit's stage
        self.fits = ModelFits()  # this model's fits on this run (set at the start of each fit)
        self.base = {"epoch": 0, "step": 0}  # the counters where this stage began
        self.settings: Dict[str, Any] = {}  # this fit's optimizer settings (fit_settings)

    # ------------------------------------------------------------------------------ the start
    def start(self, model: Any, epochs: int) -> Optional[StateTree]:
        """A fit begins: the code's plan into the core, and the checkpoint it starts from (None: it
        goes on from the state in memory, or the run is new)."""
        fits = self.fits = fits_of(model, self.core.url)
        self.core.plan = code_plan(model, epochs, fits)
        self.settings = fit_settings(model)
        if not fits.loaded:  # this fit reads the run: a finished one is compared fit by fit
            now = dict(self.settings)
            self.core.settings_differ = lambda then: differs_from_every_fit(now, then)
        return self._read(fits)

    def _read(self, fits: ModelFits) -> Optional[StateTree]:
        """The run's newest checkpoint, read at the model's first fit here (or again after a fit that
        raised or stopped), or kept by an earlier fit for this one; None when the fit goes on from the
        state in memory (the model's next stage)."""
        core = self.core
        if not fits.loaded:
            core.new_fit()
            fits.loaded, fits.tree = True, None
            return core.load(describe=kstate.describe)
        core.new_fit(keep_counters=True)  # a further stage: the counters go on
        if fits.tree is not None:  # read by an earlier fit (skipped): it belongs to this one or a later
            tree, reader, fits.tree, fits.reader = fits.tree, fits.reader, None, None
            return tree if reader is core else core.load(describe=kstate.describe)
        if fits.counters:  # the counters go on from the model's last fit (a new callback starts at 0)
            for name, value in fits.counters.items():
                core.counters[name] = value
            core.say(f"fit {fits.next + 1} of run '{core.store.run}': the next stage, after fit {fits.next} of this "
                     f"model (from epoch {fits.counters['epoch']}, step {fits.counters['step']})")
        return None

    def match(self, tree: Optional[StateTree]) -> Dict[str, Any]:
        """Set :attr:`index` to this fit's stage, matched with the checkpoint's (its
        :func:`~keepalive.callbacks._keras_state.stage_of`, returned), and the completed stages it
        records into the model's record."""
        saved, fits = kstate.stage_of(tree), self.fits
        self.index = fits.next
        if tree is not None:
            keras_part = tree.get("keras") or {}
            fits.done = list((keras_part.get("stages") or [])[:saved["index"]])
            if saved["done"]:  # the checkpoint's own fit had completed: it is a completed stage too
                fits.done.append({"epochs": keras_part.get("epochs"), "plan": tree.get("plan"),
                                  "history": keras_part.get("history")})
            self.index = self._which(saved, tree)
        self._record_settings(tree)
        return saved

    def _record_settings(self, tree: Optional[StateTree]) -> None:
        """Each checkpoint records the settings of every fit of the run so far (this one's now)."""
        core = self.core
        then = ((core.resumed_from.manifest or {}).get("metadata") or {}).get("settings") \
            if tree is not None and core.resumed_from is not None else None
        core.metadata["settings"] = {**(then or {}), **(core.metadata.get("settings") or {}),
                                     **by_fit(self.index, self.settings)}

    def _which(self, saved: Dict[str, Any], tree: StateTree) -> int:
        """The stage of the run this fit is: by position (the model's n-th fit here), unless its plan
        says otherwise (an earlier fit commented out on a re-run: the fit whose plan this one has)."""
        k, index, now = self.fits.next, saved["index"], self.core.plan
        if k > index:  # fits completed here that the checkpoint is behind (one raised before a save)
            return k
        stages = list((tree.get("keras") or {}).get("stages") or [])
        plans = {j: (stages[j] if j < len(stages) else {}).get("plan") for j in range(k, index)}
        plans[index] = tree.get("plan")
        hit = by_plan(plans, k, now)
        if hit is not None:
            return hit
        last = plans[index]
        if k == index and saved["done"] and last and any(key != "epochs" for key, _, _ in changes(last, now)):
            return index + 1  # the checkpoint's fit had completed, and this one is another fit
        return k

    def skipped(self, tree: StateTree, saved: Dict[str, Any]) -> Dict[str, Any]:
        """This fit completed before the restart (the checkpoint is in a later stage): the checkpoint
        is kept for the later fit, and the skipped stage's record (its History, its plan) returned."""
        self.fits.tree, self.fits.reader = tree, self.core
        return self.fits.done[self.index] if self.index < len(self.fits.done) else {}

    def skipped_words(self, planned: Dict[str, Any], tree: StateTree, saved: Dict[str, Any]) -> str:
        """Why a fit is skipped, and (its plan differs from the skipped fit's) how to have it
        recognised instead (its plan as before) or trained anew."""
        k, index = self.index, saved["index"]
        why = (f"fit {k + 1} of run '{self.core.store.run}' had completed before the restart (the checkpoint "
               f"is in fit {index + 1}): skipped, the newest weights loaded")
        differs = changes(planned.get("plan"), self.core.plan)
        if not differs:
            return why
        other = changes(tree.get("plan"), self.core.plan)
        return (why + f". Its plan differs from this code's ({describe(differs)})"
                + (f", and so does fit {index + 1}'s ({describe(other)})" if other else "")
                + f": if this is fit {index + 1} (the fits before it left out), set its epochs and learning rate "
                "as before to resume it; to train this fit anew, use another path or run=")

    def from_earlier_end(self, model: Any, tree: StateTree) -> None:
        """A new stage whose fit raised before a save: it starts from the checkpoint, the end of an
        earlier stage (the optimizer goes on only when the plan names none: not recompiled for it)."""
        core, k = self.core, self.index
        fresh = "optimizer" in core.plan
        kstate.load_start(model, tree, optimizer=not fresh)
        stepped = kstate.optimizer_steps(model.optimizer) if fresh else 0
        if stepped:  # this fit ran before (it raised or was interrupted before its first save)
            core.warn(f"fit {k + 1} of run '{core.store.run}' starts again from the end of fit {k}, but the "
                      f"optimizer compiled for it took {stepped} step(s) in its interrupted attempt: call "
                      "model.compile(...) again before fit for the start of a run never interrupted",
                      key="stepped-optimizer")
        if k > self.fits.next:
            differs = changes(tree.get("plan"), core.plan)
            core.warn(f"fit {k + 1} of run '{core.store.run}': fit {k} had completed before the restart "
                      f"with another plan than this fit's ({describe(differs)}), so this fit is taken as "
                      f"the next one and starts from its end state. If it is fit {k} with new settings, "
                      "use another path or run= to train it anew.", key="plan")

    def begin_here(self) -> None:
        """This stage begins where the run's counters are now."""
        self.base = {"epoch": self.core.counters["epoch"], "step": self.core.counters["step"]}

    # ----------------------------------------------------------------------------- a resume
    def done_in_fit(self) -> int:
        """The epochs of this fit done (the run's epoch counter, less the stage's start)."""
        return self.core.counters["epoch"] - self.base["epoch"]

    def already_complete(self, epochs: int, done: int, why: str = "") -> None:
        """Nothing of this fit is left to train: said (the first stage's own words in the core)."""
        k = self.index
        self.core.already_complete(epochs, detail=" (weights restored)", message=None if k == 0 and not why
                                   else why or f"fit {k + 1} of run '{self.core.store.run}' already completed "
                                   f"{done} epoch(s) of {epochs}; nothing to do (its end state restored)")

    def plan_changed(self, model: Any, done: int) -> None:
        """This code's plan differs from the checkpoint's for the fit it resumes: the code wins (its
        epochs, its learning rate); say so once, with how to get the checkpoint's instead."""
        resumed = Resumed(saved=self.core.saved_plan, now=self.core.plan, done=done)
        if not resumed.changed:
            return
        parts = []
        for key, old, new in resumed.changed:
            change = describe([(key, old, new)])
            if key == "epochs" and resumed.fewer_epochs:
                reached = " (reached already: nothing to train)" if resumed.complete else ""
                parts.append(f"{change}: this code's {new} wins, the fit ends after {new} epochs{reached} and "
                             f"counts as complete; to train the {old} planned, run fit(epochs={old}) (it goes on "
                             "from there)")
            elif key == "epochs":
                parts.append(f"{change}: this code's {new} wins, the fit goes on to {new} epochs; to end at "
                             f"{old}, run fit(epochs={old})")
            elif key == "optimizer.learning_rate" and kstate.set_learning_rate(model.optimizer, new):
                parts.append(f"{change}: this code's {new} wins (it replaces the checkpoint's rate); to go on "
                             f"with the checkpoint's, compile with learning_rate={old} as before")
            else:
                parts.append(f"{change}: this code's wins; to go on with the checkpoint's, set it as before")
        self.core.warn(f"run '{self.core.store.run}', fit {self.index + 1}: this code's plan differs from the "
                       f"checkpoint's: {'; '.join(parts)}.", key=f"plan:{self.index}:{describe(resumed.changed)}")

    # --------------------------------------------------------------------------------- the end
    def ended(self, model: Any, epochs: int) -> None:
        """The fit ended: completed (the model's next fit is the next stage, from here) or stopped
        (the next fit resumes this stage from its checkpoint)."""
        core, fits = self.core, self.fits
        if not core.finished:
            fits.loaded, fits.tree = False, None
            return
        if len(fits.done) <= self.index:
            fits.done.append({"epochs": epochs, "plan": dict(core.plan), "history": kstate.history_state(model)})
        fits.next = self.index + 1
        fits.counters = dict(core.counters)
        optimizer = model.optimizer
        fits.optimizer = weakref.ref(optimizer) if optimizer is not None else None
        core.fit_trained(core.plan)

    def abandoned(self) -> None:
        """The fit raised: run again, it starts from the newest checkpoint, as the same stage."""
        self.fits.loaded, self.fits.tree = False, None

    def record(self) -> Dict[str, Any]:
        """The stage part of a checkpoint: where this stage began, and the completed ones before it."""
        return {"stage": {"index": self.index, "epoch_base": self.base["epoch"], "step_base": self.base["step"]},
                "stages": self.fits.done[:self.index]}
