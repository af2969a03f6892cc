"""``DriveCheckpoint`` for Keras 3: one callback makes ``model.fit`` survive crashes and session limits.

>>> ckpt = DriveCheckpoint("/content/drive/MyDrive/runs/mnist")  # doctest: +SKIP
>>> model.fit(x, y, epochs=20, callbacks=[ckpt])  # doctest: +SKIP

Running the same ``fit`` again after a crash, a disconnect or a new session restores the newest
valid checkpoint and continues; one line says what was resumed. Restored:

* model variables (weights, BatchNorm statistics, the seed-generator state of every Dropout and
  random layer), optimizer variables (iteration count, moments, learning rate), metric variables
  (for a resume inside an epoch);
* the epoch / step counters: the finished epochs are skipped (the same ``fit(epochs=N)`` call runs
  only what is left), and ``History`` shows every epoch of the run;
* the global RNGs: Python, NumPy, the Keras global ``SeedGenerator``, TensorFlow's global
  ``tf.random.Generator`` and its eager op-seed sequence, torch's (Keras torch backend);
* the state of the stateful callbacks in the same ``fit``: ``EarlyStopping`` (wait, best, best
  weights), ``ReduceLROnPlateau`` (wait, cooldown, best), ``ModelCheckpoint`` (best value and save
  schedule), and any callback with ``state_dict()`` / ``load_state_dict()``;
* the data order (see below).

Data order: :class:`ResumableData` (around arrays or a ``PyDataset``) resumes exactly anywhere, also
inside an epoch. Plain arrays resume exactly at epoch ends (TensorFlow: with the same
``keras.utils.set_random_seed``; without one, said once), ``fit(steps_per_epoch=...)`` continues the
pass it keeps across epochs at the saved batch, deterministic ``tf.data`` pipelines resume exactly;
inputs that cannot (random ``tf.data``, generators) are told once, at the first save. With no kill,
adding the callback changes nothing in the training. Details: ``keepalive.callbacks._keras_data``.

Saves during the validation: with :class:`ResumableData`, a SIGTERM, a Ctrl-C, a cloud's preemption
notice or the session's deadline that comes while ``fit`` validates is saved at the next validation batch,
as of the epoch's last training batch (its running metrics and logs kept from then); a resume runs that
epoch with no batch left, so its validation and its end run once. Only when the state is still that
batch's (the optimizer's iterations, the callbacks, the weights' sums: ``SwapEMAWeights`` makes the save
wait for the epoch end, said once). Keras' optimizers have no step gate: the save comes from these
hooks, not from the core's guard thread. Other inputs: saved at the epoch end, after the validation.

Models without input shapes (no ``keras.Input``, subclassed) and compiled metrics are built at the
start of ``fit`` from a peeked batch, so a checkpoint (with a resumed epoch's running metrics) loads
before the first step. ``CSVLogger``'s file is saved with the checkpoint and continues after a resume.

Several fits (transfer learning: freeze, fit, unfreeze, recompile, fit) are stages of one run, with
one callback for all or a new ``DriveCheckpoint(path)`` in each: a fit of a model that completed a fit
on this run in this process is its next stage, from the state in memory (one that raised or stopped is
the same stage run again, from its checkpoint); counters go on across stages. A model built anew (the
script or cell run again) resumes the run: each fit is matched with the checkpoint's stages by its
position and its plan (``epochs``, the optimizer and its learning rate or schedule, stored with every
checkpoint), so a fit whose earlier fits were commented out is still recognised. Earlier completed
fits are skipped (no epoch runs; their History and the newest weights are loaded) and the stage of the
checkpoint resumes exactly; a kill before a stage's first save starts it from the previous stage's end.
A resumed fit whose plan changed (a stale ``epochs`` cell, another learning rate) follows the code,
said once with how to get the checkpoint's instead.

Put it anywhere in ``callbacks=[...]`` (it saves after all other callbacks' epoch ends). Options:
:class:`keepalive.config.CheckpointConfig`. Before the session's time limit it saves and sets
``model.stop_training`` (check ``ckpt.stopped``). Not restorable: ``keepalive.callbacks._keras_state``.
The Keras internals this relies on are listed in ``keepalive.callbacks._compat_keras`` and checked when
the callback is created: a Keras version without one is refused then, in one line.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

import keras
import numpy as np

from ..adapter import CheckpointAdapter
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..plan import changes, describe
from ..statetree import Captured, StateTree
from . import _compat_keras as kc
from . import _keras_state as kstate
from ._keras_data import (
    PassPosition,
    ResumableData,
    batch_samples,
    bind_passes,
    inexact_input,
    pass_length,
    resume_at,
    sample_batch,
    set_epoch_length,
    skip_pass,
    unbind_passes,
    unskip_pass,
)

__all__ = ["DriveCheckpoint", "ResumableData"]

if not keras.__version__.startswith("3."):  # pragma: no cover - Keras 2 has another callback API
    raise ImportError(f"keepalive.callbacks.keras needs Keras 3, found {keras.__version__}")

_LIVE: "weakref.WeakSet[DriveCheckpoint]" = weakref.WeakSet()
#: the callback whose fit is running, held strongly: a fit that raised skips on_train_end, and a
#: callback created inline (callbacks=[DriveCheckpoint(...)]) may then be garbage only for the WeakSet;
#: the next fit must still find it to release its writer lease (else: RunLockedError, depending on GC)
_RUNNING: List["DriveCheckpoint"] = []
Logs = Optional[Dict[str, Any]]


@dataclass
class _Fits:
    """What this process knows of one model's fits on one run, whichever callback object ran them
    (one per ``fit`` or one for all): module docstring, "Several fits"."""

    next: int = 0  # the stage the model's next fit is
    done: List[Dict[str, Any]] = field(default_factory=list)  # completed stages: {"epochs", "plan", "history"}
    loaded: bool = False  # the run's newest checkpoint was read; False: the next fit reads it (again)
    tree: Optional[StateTree] = None  # that checkpoint, when it belongs to a later fit than the one that read it
    reader: Optional[Checkpointer] = None  # the checkpointer that read it (another one reads it again)
    counters: Optional[Dict[str, int]] = None  # where the last completed fit ended: the next one goes on
    optimizer: Any = None  # a weak reference to the optimizer the last completed fit trained with


#: per model, per run URL: a model that completed a fit here continues the run with its next fit (a new
#: stage); a model built anew (the script or cell run again) resumes the run from its checkpoint
_FITS: "weakref.WeakKeyDictionary[Any, Dict[str, _Fits]]" = weakref.WeakKeyDictionary()


def _fits_of(model: Any, url: str) -> _Fits:
    return _FITS.setdefault(model, {}).setdefault(url, _Fits())


class _EpochEnd(keras.callbacks.Callback):
    """Appended last to the fit's callback list: runs the epoch-end save after every other callback
    has updated its state (EarlyStopping placed after DriveCheckpoint included)."""

    def __init__(self, owner: "DriveCheckpoint") -> None:
        super().__init__()
        self.owner = owner

    def on_train_begin(self, logs: Logs = None) -> None:
        if self.owner._tail is self:  # a tail left behind by a fit that raised stays inert
            self.owner._late_train_begin()

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if self.owner._tail is self:
            self.owner._epoch_end(epoch)

    def on_train_end(self, logs: Logs = None) -> None:
        if self.owner._tail is self:
            self.owner._train_end()


class DriveCheckpoint(CheckpointAdapter, keras.callbacks.Callback):
    """Checkpoint ``model.fit`` to a local folder, a mounted Drive or any fsspec URL, and resume it.

    Args:
        path: the run folder (see :class:`keepalive.config.CheckpointConfig`).
        track: more callbacks whose state to save (those in the same ``fit`` are found anyway).
        config: a ready :class:`~keepalive.config.CheckpointConfig`; keyword options override it.

    Options (``every=``, ``keep=``, ``on_deadline=``, ``quiet=``, ...): see
    :class:`keepalive.config.CheckpointConfig`. Saves inside an epoch need :class:`ResumableData`;
    otherwise a save that comes due waits for the epoch end.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]", None] = None, *, track: Sequence[Any] = (),
                 config: Optional[CheckpointConfig] = None, **options: Any) -> None:
        kc.COMPAT.check()  # every Keras internal this adapter uses exists (else one line says which)
        super().__init__()
        cfg = CheckpointConfig.strict(path, config, options, "DriveCheckpoint")
        self.core = Checkpointer(config=cfg, framework="keras")
        self.core.metadata["keras"] = {"version": keras.__version__, "backend": keras.backend.backend()}
        self.track = list(track)
        self.data: Optional[ResumableData] = None
        self._active = False
        self._stage = 0  # this fit's stage: module docstring, "Several fits"
        self._fits = _Fits()  # this model's fits on this run (set at the start of each fit)
        self._base = {"epoch": 0, "step": 0}  # the counters where this stage began
        self._reset_fit_state()
        self.core.fingerprint = self._fingerprint
        _LIVE.add(self)

    def _reset_fit_state(self) -> None:
        self._fit: Dict[str, Any] = {}  # the locals of the running fit (kstate.fit_locals: iterator, callbacks, ...)
        self._callbacks: List[Any] = []
        self._tail: Optional[_EpochEnd] = None
        self._pending: Dict[str, Any] = {}  # restored at the latest moment before the first batch
        self._adapter: Any = None  # the Keras data adapter bound to ResumableData
        self._pass: Optional[PassPosition] = None  # fit(steps_per_epoch=...): the pass kept across epochs
        self._notes: List[Any] = []  # (key, problem): what will not resume exactly, said at the first save
        self._short_epoch: Optional[int] = None
        self._pass_done = 0  # batches done in this pass over the data
        self._offset = 0  # the batch a resumed epoch starts at
        self._nothing_to_do = False
        self._torch_rng_again: Any = None
        # saves during fit's validation (keepalive.pauses): the running means and logs of the epoch's
        # training batches, as they were after its last batch (the validation resets the metrics)
        self._evaluating = False
        self._check_weights = False
        self._last_batch: Optional[Dict[str, Any]] = None

    @property
    def mid_epoch(self) -> bool:
        """Whether this fit can be checkpointed and resumed inside an epoch (ResumableData)."""
        return self.core.trigger.mid_epoch

    def _place(self, epoch: Optional[int] = None, batch: Optional[int] = None) -> None:
        """Where Keras says the run stands (epoch of this fit, a resumed epoch's first batch)."""
        if epoch is not None:
            self.core.counters["epoch"] = self._base["epoch"] + int(epoch)
        if batch is not None:
            self.core.counters["batch"] = self._offset = int(batch)

    # ---------------------------------------------------------------------------- train begin
    def _abandon(self) -> None:
        """A fit that raised (no on_train_end): release its signal handlers and writer lease."""
        self._active = False
        if self in _RUNNING:
            _RUNNING.remove(self)
        self._tail = None
        self._fits.loaded, self._fits.tree = False, None  # run again: from the newest checkpoint, same stage
        try:
            self.core.close()
        except Exception as exc:  # noqa: BLE001 - cleaning up after someone else's failure
            self.core.warn(f"could not close the checkpointer of an interrupted fit: {exc}")

    def on_train_begin(self, logs: Logs = None) -> None:
        # fit runs one at a time: an "active" checkpointer now belongs to a fit that raised
        for other in [self, *list(_LIVE), *list(_RUNNING)]:
            if other._active:
                other._abandon()
        self._reset_fit_state()
        core, model = self.core, self.model
        self._fit = kstate.fit_locals(model)
        epochs = self._epochs()
        self._callbacks = self._find_callbacks()
        self._bind_data()
        model._initial_epoch = None
        it = self._fit.get("iterator")
        problem = kstate.ensure_built(model, sample_batch(it, self.data))
        if problem:
            core.warn(problem, key="build")
        fits = self._fits = _fits_of(model, core.url)
        core.plan = self._code_plan(epochs, fits)
        tree = self._read(fits)
        self._begin_stage(tree, epochs, fits)
        core.total_epochs = (self._base["epoch"] + epochs) or None
        self._install_tail()
        core.install_signal_handlers()
        self._active = True
        _RUNNING.append(self)
        if tree is not None and not self._nothing_to_do and core.counters["epoch"] - self._base["epoch"] >= epochs:
            self._nothing_to_do = True
            self._already_complete(epochs, core.counters["epoch"] - self._base["epoch"])

    def _already_complete(self, epochs: int, done: int, why: str = "") -> None:
        k = self._stage
        self.core.already_complete(epochs, detail=" (weights restored)", message=None if k == 0 and not why
                                   else why or f"fit {k + 1} of run '{self.core.store.run}' already completed "
                                   f"{done} epoch(s) of {epochs}; nothing to do (its end state restored)")

    def _code_plan(self, epochs: int, fits: _Fits) -> Dict[str, Any]:
        """What this fit's code asks for (:mod:`keepalive.plan`), read before anything is restored: the
        epochs, and the optimizer's class and learning rate when the optimizer is new to this model's
        fits here (compiled for this fit; one that goes on from the last fit carries its rate, which
        ReduceLROnPlateau may have lowered, and is no part of the code's plan)."""
        found: Dict[str, Any] = {"epochs": epochs}
        optimizer = self.model.optimizer
        if optimizer is not None and (fits.optimizer is None or fits.optimizer() is not optimizer):
            found["optimizer"] = type(optimizer).__name__
            rate = kstate.learning_rate_plan(optimizer)
            if isinstance(rate, dict):  # a schedule: one plan value per setting (each change named)
                found.update({f"optimizer.learning_rate.{key}": value for key, value in rate.items()})
            else:
                found["optimizer.learning_rate"] = rate
        return found

    def _read(self, fits: _Fits) -> Optional[StateTree]:
        """The checkpoint this fit starts from: the run's newest, read at the model's first fit here
        (or again after a fit that raised or stopped), or kept by an earlier fit for this one; None
        when the fit goes on from the state in memory (the model's next stage)."""
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

    def _which_stage(self, saved: Dict[str, Any], tree: StateTree, fits: _Fits) -> int:
        """The stage of the run this fit is: by position (the model's n-th fit here), unless its plan
        says otherwise (an earlier fit commented out on a re-run: the fit whose plan this one has)."""
        k, index, now = fits.next, saved["index"], self.core.plan
        if k > index:  # fits completed here that the checkpoint is behind (one raised before a save)
            return k
        stages = list((tree.get("keras") or {}).get("stages") or [])
        plans = [(stages[j] if j < len(stages) else {}).get("plan") for j in range(k, index)]
        plans.append(tree.get("plan"))
        for j, planned in enumerate(plans, start=k):
            if planned and not changes(planned, now):
                return j
        last = plans[-1]
        if k == index and saved["done"] and last and any(key != "epochs" for key, _, _ in changes(last, now)):
            return index + 1  # the checkpoint's fit had completed, and this one is another fit
        return k

    def _other_plan(self, skipped: Optional[Dict[str, Any]], last: Optional[Dict[str, Any]], index: int) -> str:
        """Words for a fit skipped by its position although its plan differs from the skipped fit's:
        what differs, and how to have it recognised instead (its plan as before) or trained anew."""
        differs = changes(skipped, self.core.plan)
        if not differs:
            return ""
        other = changes(last, self.core.plan)
        return (f". Its plan differs from this code's ({describe(differs)})"
                + (f", and so does fit {index + 1}'s ({describe(other)})" if other else "")
                + f": if this is fit {index + 1} (the fits before it left out), set its epochs and learning rate "
                "as before to resume it; to train this fit anew, use another path or run=")

    def _begin_stage(self, tree: Optional[StateTree], epochs: int, fits: _Fits) -> None:
        """Match this fit with the checkpoint's stage (module docstring, "Several fits")."""
        core, saved = self.core, kstate.stage_of(tree)
        self._stage = fits.next
        if tree is not None:
            index = saved["index"]
            fits.done = list(((tree.get("keras") or {}).get("stages") or [])[:index])
            if saved["done"]:  # the checkpoint's own fit had completed: it is a completed stage too
                keras_part = tree.get("keras") or {}
                fits.done.append({"epochs": keras_part.get("epochs"), "plan": tree.get("plan"),
                                  "history": keras_part.get("history")})
            self._stage = self._which_stage(saved, tree, fits)
        k = self._stage
        if tree is not None and saved["index"] > k:  # completed before the restart: skipped
            fits.tree, fits.reader, self._nothing_to_do = tree, core, True
            planned = (fits.done[k] if k < len(fits.done) else {})
            self._pending = {"history": planned.get("history")}
            kstate.assign_if_fits(self.model.variables, (tree.get("objects") or {}).get("model"))
            self.model._initial_epoch = max(epochs, int(self._fit.get("initial_epoch") or 0))
            self._already_complete(epochs, epochs, why=(
                f"fit {k + 1} of run '{core.store.run}' had completed before the restart (the checkpoint "
                f"is in fit {saved['index'] + 1}): skipped, the newest weights loaded"
                + self._other_plan(planned.get("plan"), tree.get("plan"), saved["index"])))
        elif tree is not None and saved["index"] == k:
            self._base = {"epoch": saved["epoch_base"], "step": saved["step_base"]}
            self.restore(tree, epochs)
        else:  # a new stage; from an earlier stage's end when this stage's fit raised before a save
            if tree is not None:
                # the optimizer goes on only when the plan names none (not recompiled for this fit)
                fresh = "optimizer" in core.plan
                kstate.load_start(self.model, tree, optimizer=not fresh)
                stepped = kstate.optimizer_steps(self.model.optimizer) if fresh else 0
                if stepped:  # this fit ran before (it raised or was interrupted before its first save)
                    core.warn(f"fit {k + 1} of run '{core.store.run}' starts again from the end of fit {k}, but the "
                              f"optimizer compiled for it took {stepped} step(s) in its interrupted attempt: call "
                              "model.compile(...) again before fit for the start of a run never interrupted",
                              key="stepped-optimizer")
                self._pending = {"rng": tree.get("rng")}
                if k > fits.next:
                    differs = changes(tree.get("plan"), core.plan)
                    core.warn(f"fit {k + 1} of run '{core.store.run}': fit {k} had completed before the restart "
                              f"with another plan than this fit's ({describe(differs)}), so this fit is taken as "
                              f"the next one and starts from its end state. If it is fit {k} with new settings, "
                              "use another path or run= to train it anew.", key="plan")
            self._base = {"epoch": core.counters["epoch"], "step": core.counters["step"]}
            first = int(self._fit.get("initial_epoch") or 0)  # fit(initial_epoch=...) of the user
            self._place(epoch=first)
            if self.data is not None:
                self.data.plan(first, 0)

    def _epochs(self) -> int:
        """fit(epochs=...): from the callback params, else from fit's own arguments (a CallbackList
        passed to fit gets no params)."""
        return int((self.params or {}).get("epochs") or self._fit.get("epochs") or 0)

    def _find_callbacks(self) -> List[Any]:
        found = list(getattr(self._fit.get("callbacks"), "callbacks", []) or [])
        found += [cb for cb in self.track if cb not in found]
        return [cb for cb in found if cb is not self and not isinstance(cb, _EpochEnd)]

    def _install_tail(self) -> None:
        lst = getattr(self._fit.get("callbacks"), "callbacks", None)
        if isinstance(lst, list) and self in lst:
            self._tail = _EpochEnd(self)
            self._tail.set_model(self.model)
            self._tail.set_params(self.params or {})
            lst.append(self._tail)  # appending while the list is iterated: it is reached last
        else:
            self.core.warn("could not find the callback list of this fit (unknown Keras layout); "
                           "callbacks listed after DriveCheckpoint save their state one epoch late. "
                           "Put DriveCheckpoint last in callbacks=[...].", key="callback-list")

    def _bind_data(self) -> None:
        """Find the fit's input; with ResumableData, bind each pass to its epoch (mid-epoch saves)."""
        it = self._fit.get("iterator")
        self.data, self._adapter, problem = bind_passes(it)
        self.core.trigger.mid_epoch = self.data is not None
        if problem:
            self.core.warn(problem, key="resumable-data")
        self._pass = PassPosition(it, self.data) if it is not None else None
        inexact = inexact_input(it, self.data)
        if inexact:
            self._notes.append(("inexact-data", inexact))
        elif self._pass is not None and self._pass.problem:
            self._notes.append(("data-pass", self._pass.problem))

    # -------------------------------------------------------------------------------- restore
    def restore(self, tree: StateTree, epochs: Optional[int] = None) -> None:
        """Put a loaded tree into the model, optimizer, metrics, callbacks and the data position of
        this fit (of ``epochs``, default the fit's own)."""
        epochs = self._epochs() if epochs is None else epochs
        core, model = self.core, self.model
        objects = tree.get("objects", {})
        kstate.load_variables(model, tree, core.resumed_from.url if core.resumed_from else "?")
        saved = tree.get("keras", {}) or {}
        epoch = core.counters["epoch"] - self._base["epoch"]  # the epoch of this fit
        self._plan_changed(changes(core.saved_plan, core.plan), epoch)
        batch, problems = resume_at(self.data, tree.get("data") or {}, epoch, int(tree["counters"].get("batch", 0)))
        problem = self._pass.restore((tree.get("data") or {}).get("pass")) if self._pass is not None else None
        for line in problems + ([problem] if problem else []):
            core.warn(line)
        it = self._fit.get("iterator")
        if batch and self.data is not None:
            self._short_epoch = epoch
            set_epoch_length(it, self._callbacks, self.data.batches_per_epoch - batch)
            if batch == self.data.batches_per_epoch:  # saved during the epoch's validation
                skip_pass(it, self.data)
        self._place(batch=batch)
        problem = kstate.seed_mismatch(it, tree.get("rng") or {}) if self.data is None else None
        if problem:
            core.warn(problem, key="seed")
        self._pending = {"metrics": objects.get("metrics") if batch else None,
                         "last_logs": saved.get("last_logs") if batch else None,
                         "callbacks": saved.get("callbacks") or {},
                         "history": saved.get("history"), "rng": tree.get("rng")}
        start = epoch
        if saved.get("ended_early"):
            # the run ended early (EarlyStopping or stop_training): running it again does nothing
            self._nothing_to_do = True
            start = max(epochs, epoch)
            core.already_complete(message=f"run '{core.store.run}' ended early at epoch {epoch} (e.g. "
                                  "EarlyStopping) and is complete; nothing to do (weights restored). Use "
                                  "another path or run= to train anew.")
        model._initial_epoch = start

    def _plan_changed(self, found: List[Any], done: int) -> None:
        """This code's plan differs from the checkpoint's for the fit it resumes: the code wins (its
        epochs, its learning rate); say so once, with how to get the checkpoint's instead."""
        if not found:
            return
        parts = []
        for key, old, new in found:
            change = describe([(key, old, new)])
            if key == "epochs" and new < old:
                reached = " (reached already: nothing to train)" if done >= new else ""
                parts.append(f"{change}: this code's {new} wins, the fit ends after epoch {new}{reached} and "
                             f"counts as complete; to train the {old} planned, run fit(epochs={old}) (it goes on "
                             "from there)")
            elif key == "epochs":
                parts.append(f"{change}: this code's {new} wins, the fit goes on to epoch {new}; to end at "
                             f"{old}, run fit(epochs={old})")
            elif key == "optimizer.learning_rate" and kstate.set_learning_rate(self.model.optimizer, new):
                parts.append(f"{change}: this code's {new} wins (it replaces the checkpoint's rate); to go on "
                             f"with the checkpoint's, compile with learning_rate={old} as before")
            else:
                parts.append(f"{change}: this code's wins; to go on with the checkpoint's, set it as before")
        self.core.warn(f"run '{self.core.store.run}', fit {self._stage + 1}: this code's plan differs from the "
                       f"checkpoint's: {'; '.join(parts)}.", key=f"plan:{self._stage}:{describe(found)}")

    def _late_train_begin(self) -> None:
        """After every callback's on_train_begin (they reset their state there): restore theirs,
        History's, and the RNGs, as late as possible before the first batch."""
        pending = self._pending
        if not pending:
            return
        kstate.restore_callback_states(self._callbacks, pending.get("callbacks") or {})
        kstate.restore_history(self.model, pending.get("history"))
        saved_rng = pending.get("rng")
        if saved_rng:
            self.core.restore_rng(pending)
            if self._offset and keras.backend.backend() == "torch" and "torch_cpu" in saved_rng:
                # Each pass's torch DataLoader draws a seed from torch's generator, which an uninterrupted
                # run did at this epoch's start, before the save: put the generator back after it.
                self._torch_rng_again = saved_rng["torch_cpu"]
        pending["callbacks"] = pending["history"] = pending["rng"] = None

    # ---------------------------------------------------------------------------------- loop
    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        if not self._active:
            return
        if self._tail is None:
            self._late_train_begin()
        self.model._initial_epoch = None  # read by fit already; never leak into a later fit
        self._place(epoch=epoch)
        self.core.start_epoch()
        self._pass_done = 0
        metrics = self._pending.pop("metrics", None) if self._pending else None
        # after fit's reset_metrics(): the resumed epoch's running means
        if metrics is not None and not kstate.restore_metrics(self.model, metrics):
            self.core.warn(f"the compiled metrics differ from the checkpoint's; epoch {epoch}'s logged "
                           "metrics cover only the batches after the resume", key="metrics")
        last_logs = self._pending.pop("last_logs", None) if self._pending else None
        if last_logs is not None and not kstate.replay_last_logs(self.model, last_logs):
            self.core.warn(f"epoch {epoch} resumes after its last batch, but this Keras version's fit "
                           "cannot be given that batch's logs: the epoch's logged training metrics are "
                           "missing (the weights are exact)", key="last-logs")

    def on_train_batch_begin(self, batch: int, logs: Logs = None) -> None:
        if self._torch_rng_again is not None:
            kstate.set_torch_rng(self._torch_rng_again)
            self._torch_rng_again = None

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        if not self._active:
            return
        core = self.core
        done = int(batch) + 1  # batches done in this pass (batch = last step of the execution)
        length = pass_length(self._fit.get("iterator"))
        if length:  # the last execution of a pass may hold fewer than steps_per_execution steps
            done = min(done, length)
        n = max(0, done - self._pass_done)
        self._pass_done = done
        first = core.counters["batch"]
        samples = self.data.samples_between(first, n) if self.data is not None else \
            batch_samples(getattr(self._fit.get("iterator"), "data_adapter", None), first, n)
        # The epoch's last batch: its end (validation, other callbacks) has not run yet; a resume from
        # here runs an epoch with no batch left (its validation and its end, once). A signal that came
        # during it is saved here; a scheduled save or a deadline stop due here waits for the epoch end
        # (after the other callbacks' epoch-end updates). The state after it is also where a save
        # during the validation starts from (keepalive.pauses): the running means and logs the
        # validation will replace are kept, and the mark includes the weights' sums.
        last = self.data is not None and self._offset + done >= self.data.batches_per_epoch
        if last:
            self._last_batch = {"metrics": [np.array(kstate.variable_array(v)) for v in self.model.metrics_variables],
                                "logs": dict(logs or {})}
        signalled = core.pending_signal is not None
        decision = core.advance(self.capture, steps=n, batch=self._offset + done, samples=samples,
                                can_save=core.trigger.mid_epoch and (not last or signalled))
        if decision.stop:
            self.model.stop_training = True
        elif last and core.trigger.mid_epoch:
            self._check_weights = True
            try:
                core.pause_point(self.capture)  # the core's mark, as a boundary that can save makes it
            finally:
                self._check_weights = False

    def _fingerprint(self) -> Tuple[Any, Any]:
        """The core's check that nothing moved since the last boundary (:mod:`keepalive.pauses`): what
        capture reads beside the variables' values, and where the training's pass over the data is.
        Before and during the validation also the weights' sums (no version counters on TensorFlow /
        JAX: an EMA swapped into the model for the validation would otherwise be saved as its weights)."""
        objects = kstate.state_fingerprint(self.model, self._callbacks)
        if self._check_weights or self._evaluating:
            objects += kstate.weights_checksum(self.model)
        return objects, (self._offset, self._pass_done)

    # ------------------------------------------------------------- fit's validation (a pause)
    def on_test_begin(self, logs: Logs = None) -> None:
        # fit's own validation (evaluate called by fit with fit's callbacks), not an evaluate of the user
        self._evaluating = self._active and bool(self._fit)
        self._pause()

    def on_test_batch_end(self, batch: int, logs: Logs = None) -> None:
        self._pause()

    def on_test_end(self, logs: Logs = None) -> None:
        self._pause()
        self._evaluating = False

    def _pause(self) -> None:
        """A validation batch: the training is alive, and what cannot wait for the epoch end (a signal,
        a preemption notice, the deadline) is saved now, as of the last training batch."""
        if self._evaluating:
            self.core.active(self.capture)

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if self._tail is None:  # no tail installed: do the epoch end here
            self._epoch_end(epoch)

    def _epoch_end(self, epoch: int) -> None:
        core = self.core
        if not self._active or core.stopped:  # stopped inside this epoch: it is not complete
            return
        self._offset = 0
        if self._short_epoch is not None and self.data is not None:
            set_epoch_length(self._fit["iterator"], self._callbacks, self.data.batches_per_epoch)
            unskip_pass(self._fit["iterator"])
            self._short_epoch = None
        self._last_batch = None
        done = int(epoch) + 1
        last = done >= self._epochs() or bool(self.model.stop_training)
        if core.end_epoch(self.capture, last=last, epoch=self._base["epoch"] + done).stop:
            self.model.stop_training = True

    def on_train_end(self, logs: Logs = None) -> None:
        if self._tail is None:
            self._train_end()

    def _train_end(self) -> None:
        if not self._active:
            return
        self._active = False
        if self in _RUNNING:
            _RUNNING.remove(self)
        core = self.core
        try:
            if not core.finished and not core.stopped:
                # fit ended without our last-epoch marker (e.g. stopped by a callback after us)
                core.end_epoch(self.capture, last=True, count=False)
        finally:
            fits = self._fits
            if core.finished:  # this fit (stage) is complete: the model's next fit is the next stage
                if len(fits.done) <= self._stage:
                    fits.done.append({"epochs": self._epochs(), "plan": dict(core.plan),
                                      "history": kstate.history_state(self.model)})
                fits.next = self._stage + 1
                fits.counters = dict(core.counters)
                optimizer = self.model.optimizer
                fits.optimizer = weakref.ref(optimizer) if optimizer is not None else None
                core.fit_trained(core.plan)
            else:  # stopped (deadline, interrupt): the next fit resumes this stage from its checkpoint
                fits.loaded, fits.tree = False, None
            self.model._initial_epoch = None
            if self._adapter is not None:
                unbind_passes(self._adapter)
                self._adapter = None
            if self._pass is not None:
                self._pass.unbind()
                self._pass = None
            unskip_pass(self._fit.get("iterator"))
            lst = getattr(self._fit.get("callbacks"), "callbacks", None)
            if self._tail is not None and isinstance(lst, list) and self._tail in lst:
                lst.remove(self._tail)
            self._tail = None
            self._fit = {}
            core.close()

    # ------------------------------------------------------------------------------- capture
    def capture(self) -> Captured:
        core, epochs = self.core, self._epochs()
        for key, problem in self._notes:  # said at the first save (once per run: the keys)
            core.warn(problem, key=key)
        self._notes = []
        stage = {"index": self._stage, "epoch_base": self._base["epoch"], "step_base": self._base["step"]}
        tree = cast(Captured, kstate.capture_tree(
            self.model, self._callbacks, epochs=epochs, finished=core.finished,
            ended_early=core.counters["epoch"] - self._base["epoch"] < epochs, stage=stage,
            stages=self._fits.done[:self._stage]))
        data: Dict[str, Any] = {"kind": "resumable" if self.data is not None else "keras"}
        if self.data is not None:
            data.update(seed=self.data.seed, batches_per_epoch=self.data.batches_per_epoch)
        position = self._pass.state() if self._pass is not None else None
        if position is not None:
            data["pass"] = position
        tree["data"] = data
        if self._last_batch is not None:
            # saved after the epoch's last batch (during its validation, or at that batch): its end has
            # not run; the running means as the training batches left them (the validation resets them)
            tree["objects"]["metrics"] = self._last_batch["metrics"]
            tree["keras"]["last_logs"] = self._last_batch["logs"]
        return tree
