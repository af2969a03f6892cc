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

Models without input shapes (no ``keras.Input``, subclassed) and compiled metrics are built at the
start of ``fit`` from a peeked batch, so a checkpoint (with a resumed epoch's running metrics) loads
before the first step. ``CSVLogger``'s file is saved with the checkpoint and continues after a resume.

Several fits with one callback (transfer learning: freeze, fit, unfreeze, recompile, fit) are stages
of one run: the n-th ``fit`` that completes is stage n (one that raised or stopped is the same stage
run again); counters go on across stages. Re-running the whole script after a kill in stage n skips
each earlier ``fit`` (no epoch runs; its History and the newest weights are loaded) and resumes stage
n exactly; a kill before stage n's first save restores stage n-1's end. Create the callback once.

Put it anywhere in ``callbacks=[...]`` (it saves after all other callbacks' epoch ends). Options:
:class:`keepalive.config.CheckpointConfig`. Before the session's time limit it saves and sets
``model.stop_training`` (check ``ckpt.stopped``). Not restorable: ``keepalive.callbacks._keras_state``.
The Keras internals this relies on are listed in ``keepalive.callbacks._compat_keras`` and checked when
the callback is created: a Keras version without one is refused then, in one line.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Dict, List, Optional, Sequence, Union, cast

import keras

from ..adapter import CheckpointAdapter
from ..config import CheckpointConfig
from ..core import Checkpointer
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
    unbind_passes,
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
        self._stages: List[Dict[str, Any]] = []  # completed stages: {"epochs", "history"}
        self._loaded = False  # the run's newest checkpoint was read (once, at the first fit)
        self._tree: Optional[StateTree] = None  # it, kept for a later stage it belongs to
        self._base = {"epoch": 0, "step": 0}  # the counters where this stage began
        self._reset_fit_state()
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
        self._loaded, self._tree = False, None  # run again: from the newest checkpoint, same stage
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
        if self._loaded:
            core.new_fit(keep_counters=True)  # a further stage: the counters go on
        else:
            core.new_fit()
            self._tree, self._loaded = core.load(describe=kstate.describe), True
        tree, self._tree = self._tree, None
        self._begin_stage(tree, epochs)
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

    def _begin_stage(self, tree: Optional[StateTree], epochs: int) -> None:
        """Match this fit with the checkpoint's stage (module docstring, "Several fits")."""
        core, k, saved = self.core, self._stage, kstate.stage_of(tree)
        if tree is not None:
            self._stages = list(((tree.get("keras") or {}).get("stages") or [])[:saved["index"]])
        if tree is not None and saved["index"] > k:  # completed before the restart: skipped
            self._tree, self._nothing_to_do = tree, True
            self._pending = {"history": (self._stages[k] if k < len(self._stages) else {}).get("history")}
            kstate.assign_if_fits(self.model.variables, (tree.get("objects") or {}).get("model"))
            self.model._initial_epoch = max(epochs, int(self._fit.get("initial_epoch") or 0))
            self._already_complete(epochs, epochs, why=(
                f"fit {k + 1} of run '{core.store.run}' had completed before the restart (the checkpoint "
                f"is in fit {saved['index'] + 1}): skipped, the newest weights loaded"))
        elif tree is not None and saved["index"] == k:
            self._base = {"epoch": saved["epoch_base"], "step": saved["step_base"]}
            self.restore(tree, epochs)
        else:  # a new stage; from an earlier stage's end when this stage's fit raised before a save
            if tree is not None:
                kstate.load_start(self.model, tree)
                self._pending = {"rng": tree.get("rng")}
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
        batch, problems = resume_at(self.data, tree.get("data") or {}, epoch, int(tree["counters"].get("batch", 0)))
        problem = self._pass.restore((tree.get("data") or {}).get("pass")) if self._pass is not None else None
        for line in problems + ([problem] if problem else []):
            core.warn(line)
        it = self._fit.get("iterator")
        if batch and self.data is not None:
            self._short_epoch = epoch
            set_epoch_length(it, self._callbacks, self.data.batches_per_epoch - batch)
        self._place(batch=batch)
        problem = kstate.seed_mismatch(it, tree.get("rng") or {}) if self.data is None else None
        if problem:
            core.warn(problem, key="seed")
        self._pending = {"metrics": objects.get("metrics") if batch else None,
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
        # The epoch's last batch: its end (validation, other callbacks) has not run yet, and a resume
        # cannot replay an epoch end without batches. A save or a deadline stop due here is carried
        # out at the epoch end (the core defers both).
        last = self.data is not None and self._offset + done >= self.data.batches_per_epoch
        decision = core.advance(self.capture, steps=n, batch=self._offset + done, samples=samples,
                                can_save=core.trigger.mid_epoch and not last)
        if decision.stop:
            self.model.stop_training = True

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
            self._short_epoch = None
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
            if core.finished:  # this fit (stage) is complete: the next fit is the next stage
                if len(self._stages) <= self._stage:
                    self._stages.append({"epochs": self._epochs(), "history": kstate.history_state(self.model)})
                self._stage += 1
            self.model._initial_epoch = None
            if self._adapter is not None:
                unbind_passes(self._adapter)
                self._adapter = None
            if self._pass is not None:
                self._pass.unbind()
                self._pass = None
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
            ended_early=core.counters["epoch"] - self._base["epoch"] < epochs, stage=stage, stages=self._stages))
        data: Dict[str, Any] = {"kind": "resumable" if self.data is not None else "keras"}
        if self.data is not None:
            data.update(seed=self.data.seed, batches_per_epoch=self.data.batches_per_epoch)
        position = self._pass.state() if self._pass is not None else None
        if position is not None:
            data["pass"] = position
        tree["data"] = data
        return tree
