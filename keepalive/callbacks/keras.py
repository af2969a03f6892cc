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
``model.stop_training``; ``fit`` then ends with the stop (a script's ``SystemExit(143)``, a notebook's
``TrainingStopped``: :mod:`keepalive.lifecycle.stops`). Not restorable: ``keepalive.callbacks._keras_state``.
The Keras internals this relies on are listed in ``keepalive.callbacks._compat_keras`` and checked when
the callback is created: a Keras version without one is refused then, in one line.

Parts: the hooks here say when; which stage a fit is and where it begins is
``keepalive.callbacks._keras_stages`` (its plan rules: :mod:`keepalive.plan`), the fit's input
``keepalive.callbacks._keras_input``, what is captured and restored ``keepalive.callbacks._keras_state``.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

import keras
import numpy as np

from ..adapter import CheckpointAdapter
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..statetree import Captured, StateTree
from . import _compat_keras as kc
from . import _keras_state as kstate
from ._keras_data import ResumableData, pass_length, sample_batch
from ._keras_input import FitInput
from ._keras_stages import Stages

__all__ = ["DriveCheckpoint", "ResumableData"]

if not keras.__version__.startswith("3."):  # pragma: no cover - Keras 2 has another callback API
    raise ImportError(f"keepalive.callbacks.keras needs Keras 3, found {keras.__version__}")

_LIVE: "weakref.WeakSet[DriveCheckpoint]" = weakref.WeakSet()
#: the callback whose fit is running, held strongly: a fit that raised skips on_train_end, and a
#: callback created inline (callbacks=[DriveCheckpoint(...)]) may then be garbage only for the WeakSet;
#: the next fit must still find it to release its writer lease (else: RunLockedError, depending on GC)
_RUNNING: List["DriveCheckpoint"] = []
Logs = Optional[Dict[str, Any]]


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
        self._active = False
        self._stages = Stages(self.core)  # which fit of the run this is: module docstring, "Several fits"
        self._reset_fit_state()
        self.core.fingerprint = self._fingerprint
        _LIVE.add(self)

    def _reset_fit_state(self) -> None:
        self._fit: Dict[str, Any] = {}  # the locals of the running fit (kstate.fit_locals: iterator, callbacks, ...)
        self._callbacks: List[Any] = []
        self._tail: Optional[_EpochEnd] = None
        self._pending: Dict[str, Any] = {}  # restored at the latest moment before the first batch
        self._input = FitInput(self.core, None, [])  # this fit's input (bound at its start)
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
    def data(self) -> Optional[ResumableData]:
        """The running fit's :class:`ResumableData` (None: another input, or no fit)."""
        return self._input.data

    @property
    def mid_epoch(self) -> bool:
        """Whether this fit can be checkpointed and resumed inside an epoch (ResumableData)."""
        return self.core.trigger.mid_epoch

    def _place(self, epoch: Optional[int] = None, batch: Optional[int] = None) -> None:
        """Where Keras says the run stands (epoch of this fit, a resumed epoch's first batch)."""
        if epoch is not None:
            self.core.counters["epoch"] = self._stages.base["epoch"] + int(epoch)
        if batch is not None:
            self.core.counters["batch"] = self._offset = int(batch)

    # ---------------------------------------------------------------------------- train begin
    def _abandon(self) -> None:
        """A fit that raised (no on_train_end): release its signal handlers and writer lease."""
        self._active = False
        if self in _RUNNING:
            _RUNNING.remove(self)
        self._tail = None
        self._stages.abandoned()
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
        self._input = FitInput(core, self._fit.get("iterator"), self._callbacks)
        self._input.bind()
        model._initial_epoch = None
        problem = kstate.ensure_built(model, sample_batch(self._fit.get("iterator"), self.data))
        if problem:
            core.warn(problem, key="build")
        tree = self._stages.start(model, epochs)
        self._begin_stage(tree, epochs)
        core.total_epochs = (self._stages.base["epoch"] + epochs) or None
        self._install_tail()
        core.install_signal_handlers()
        self._active = True
        _RUNNING.append(self)
        done = self._stages.done_in_fit()
        if tree is not None and not self._nothing_to_do and done >= epochs:
            self._nothing_to_do = True
            self._stages.already_complete(epochs, done)

    def _begin_stage(self, tree: Optional[StateTree], epochs: int) -> None:
        """Match this fit with the checkpoint's stage (module docstring, "Several fits") and start it:
        skipped (completed before the restart), resumed from the checkpoint, or a new stage."""
        stages, model = self._stages, self.model
        saved = stages.match(tree)
        if tree is not None and saved["index"] > stages.index:  # completed before the restart: skipped
            planned = stages.skipped(tree, saved)
            self._nothing_to_do = True
            self._pending = {"history": planned.get("history")}
            kstate.assign_if_fits(model.variables, (tree.get("objects") or {}).get("model"))
            model._initial_epoch = max(epochs, int(self._fit.get("initial_epoch") or 0))
            stages.already_complete(epochs, epochs, why=stages.skipped_words(planned, tree, saved))
        elif tree is not None and saved["index"] == stages.index:
            stages.base = {"epoch": saved["epoch_base"], "step": saved["step_base"]}
            self.restore(tree, epochs)
        else:  # a new stage; from an earlier stage's end when this stage's fit raised before a save
            if tree is not None:
                stages.from_earlier_end(model, tree)
                self._pending = {"rng": tree.get("rng")}
            stages.begin_here()
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

    # -------------------------------------------------------------------------------- restore
    def restore(self, tree: StateTree, epochs: Optional[int] = None) -> None:
        """Put a loaded tree into the model, optimizer, metrics, callbacks and the data position of
        this fit (of ``epochs``, default the fit's own)."""
        epochs = self._epochs() if epochs is None else epochs
        core, model = self.core, self.model
        objects = tree.get("objects", {})
        kstate.load_variables(model, tree, core.loaded_url)
        saved = tree.get("keras", {}) or {}
        epoch = self._stages.done_in_fit()  # the epoch of this fit
        self._stages.plan_changed(model, epoch)
        batch = self._input.restore(tree.get("data") or {}, epoch, int(tree["counters"].get("batch", 0)))
        self._place(batch=batch)
        problem = kstate.seed_mismatch(self._fit.get("iterator"), tree.get("rng") or {}) if self.data is None else None
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
            core.already_complete(message=f"run '{core.store.run}' ended early after {epoch} epoch(s) (e.g. "
                                  "EarlyStopping) and is complete; nothing to do (weights restored). Use "
                                  "another path or run= to train anew.")
        model._initial_epoch = start

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
        samples = self._input.samples(first, n)
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
        self.core.heartbeat.log(logs or {})  # the epoch's history, into the run's session record
        if self._tail is None:  # no tail installed: do the epoch end here
            self._epoch_end(epoch)

    def _epoch_end(self, epoch: int) -> None:
        core = self.core
        if not self._active or core.stopped:  # stopped inside this epoch: it is not complete
            return
        self._offset = 0
        self._input.epoch_ended()
        self._last_batch = None
        done = int(epoch) + 1
        last = done >= self._epochs() or bool(self.model.stop_training)
        if core.end_epoch(self.capture, last=last, epoch=self._stages.base["epoch"] + done).stop:
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
            self._stages.ended(self.model, self._epochs())
            self.model._initial_epoch = None
            self._input.release()
            lst = getattr(self._fit.get("callbacks"), "callbacks", None)
            if self._tail is not None and isinstance(lst, list) and self._tail in lst:
                lst.remove(self._tail)
            self._tail = None
            self._fit = {}
            core.close()

    # ------------------------------------------------------------------------------- capture
    def capture(self) -> Captured:
        core, epochs = self.core, self._epochs()
        for key, problem in self._input.take_notes():  # said at the first save (once per run: the keys)
            core.warn(problem, key=key)
        record = self._stages.record()
        tree = cast(Captured, kstate.capture_tree(
            self.model, self._callbacks, epochs=epochs, finished=core.finished,
            ended_early=self._stages.done_in_fit() < epochs, stage=record["stage"], stages=record["stages"]))
        tree["data"] = self._input.state()
        if self._last_batch is not None:
            # saved after the epoch's last batch (during its validation, or at that batch): its end has
            # not run; the running means as the training batches left them (the validation resets them)
            tree["objects"]["metrics"] = self._last_batch["metrics"]
            tree["keras"]["last_logs"] = self._last_batch["logs"]
        return tree
