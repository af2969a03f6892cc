"""``DriveCheckpoint`` for Keras 3: one callback makes ``model.fit`` survive crashes and session limits.

>>> model.fit(x, y, epochs=20, callbacks=[DriveCheckpoint("/content/drive/MyDrive/runs/mnist")])  # doctest: +SKIP

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

Data order. Which inputs resume exactly:

* :class:`ResumableData` (``from keepalive.callbacks.keras import ResumableData``) around NumPy arrays
  or a ``keras.utils.PyDataset``: every epoch's order is a function of (seed, epoch), so any
  ``every=`` works and a resume starts in the middle of an epoch at the saved batch (no skipped batch
  is loaded). Use it for ``every=<steps>`` or ``every="10min"`` and for exact deadline stops.
* Plain NumPy arrays with ``shuffle=True`` on the TensorFlow backend: Keras draws the order inside a
  ``tf.data`` graph from TensorFlow's global seed (``keras.utils.set_random_seed``), fixed when
  ``fit`` builds its pipeline; that order does not depend on anything a restart changes, so resuming
  at an epoch boundary is exact provided the re-run sets the same seed before ``fit`` (a differing
  seed is reported). Checkpoints are then written at epoch ends only (a step / time schedule that
  comes due saves at the epoch end). Note that with a global seed Keras 3 draws *the same order in
  every epoch* this way (the pipeline is rebuilt per epoch from the same seeds, cf.
  tensorflow/tensorflow#29558); ``ResumableData`` reshuffles per epoch. Without a global seed the
  order is random in every run anyway.
* Plain arrays on the torch backend: Keras shuffles with a torch ``RandomSampler`` drawing from
  torch's global generator, which is restored: exact at epoch boundaries.
* ``tf.data.Dataset`` (its shuffle buffer and iterator state live inside TensorFlow), generators and
  other PyDatasets (with ``shuffle=True`` Keras shuffles their batch order with Python's ``random``
  when a pass starts, which the TensorFlow backend does ahead of time, before the previous epoch's
  end is saved): epoch-end checkpoints, and the order after a resume is whatever the pipeline
  produces then: not guaranteed to be the uninterrupted run's. Wrap arrays / PyDatasets in
  :class:`ResumableData` for exactness anywhere. ``fit(steps_per_epoch=...)`` and PyDatasets with
  ``workers > 1`` also mean epoch-end checkpoints.

Where to put it: anywhere in ``callbacks=[...]``; it arranges to save after all other callbacks'
epoch ends. ``every=`` is ``"epoch"`` (default), an int (optimizer steps) or a duration (``"10min"``).
Before the session's time limit (Colab / Kaggle, ``KEEPALIVE_BUDGET``) it saves and sets
``model.stop_training`` with a message; check ``ckpt.stopped`` after ``fit``.

TF1-style unseeded random ops inside ``tf.function`` / ``tf.data`` graphs (``tf.random.uniform``
without a seed) keep their position in TensorFlow kernels no library can read; Keras' own layers use
``SeedGenerator`` states, which are restored.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import keras

from .. import rng as _rng
from ..core import Checkpointer, CheckpointerViews, say
from ..errors import StateMismatchError
from ._keras_data import ResumableData

log = logging.getLogger("keepalive.keras")

__all__ = ["DriveCheckpoint", "ResumableData"]

if not keras.__version__.startswith("3."):  # pragma: no cover - Keras 2 has another callback API
    raise ImportError(f"keepalive.callbacks.keras needs Keras 3, found {keras.__version__}")

_LIVE: "weakref.WeakSet[DriveCheckpoint]" = weakref.WeakSet()

# The attributes that make up the state of Keras' stateful callbacks (subclasses included).
_CALLBACK_STATE = {
    keras.callbacks.EarlyStopping: ("wait", "stopped_epoch", "best", "best_epoch", "best_weights"),
    keras.callbacks.ReduceLROnPlateau: ("wait", "cooldown_counter", "best"),
    keras.callbacks.ModelCheckpoint: ("best", "_current_epoch", "_batches_seen_since_last_saving",
                                      "_last_batch_seen"),
}


# ------------------------------------------------------------------------------- framework RNGs
def _keras_seed_capture() -> Any:
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    gen = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    return None if gen is None else np.array(gen.state.numpy())


def _keras_seed_restore(state: Any) -> None:
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    if state is None:  # created lazily later, as in the run that saved
        global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, None)
        return
    from keras.src.random.seed_generator import global_seed_generator

    gen = global_seed_generator()
    gen.state.assign(np.asarray(state).astype(gen.state.dtype))


def _tf_generator_capture() -> Any:
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return None
    from tensorflow.python.ops import stateful_random_ops

    gen = stateful_random_ops.global_generator
    if gen is None:
        return None
    return {"state": gen.state.numpy().copy(), "algorithm": int(gen.algorithm)}


def _tf_generator_restore(saved: Any) -> None:
    tf = sys.modules.get("tensorflow")
    if tf is None or not saved:
        return
    gen = tf.random.get_global_generator()
    if int(gen.algorithm) != int(saved["algorithm"]):
        tf.random.set_global_generator(tf.random.Generator.from_state(
            np.asarray(saved["state"]), alg=int(saved["algorithm"])))
        return
    gen.state.assign(np.asarray(saved["state"]))


def _tf_op_seeds_capture() -> Any:
    """TF's eager op-seed sequence: unseeded eager ``tf.random.*`` calls draw their seeds from it."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return None
    from tensorflow.python.eager import context

    ctx = context.context()
    seq = getattr(ctx, "_rng", None)
    if seq is None or getattr(ctx, "_seed", None) is None:
        return None
    version, internal, gauss = seq.getstate()
    return {"seed": int(ctx._seed), "state": [int(version), list(internal), gauss]}


def _tf_op_seeds_restore(saved: Any) -> None:
    tf = sys.modules.get("tensorflow")
    if tf is None or not saved:
        return
    from tensorflow.python.eager import context

    ctx = context.context()
    if getattr(ctx, "_seed", None) != saved["seed"]:
        ctx._set_global_seed(saved["seed"])
    version, internal, gauss = saved["state"]
    ctx._rng.setstate((int(version), tuple(int(v) for v in internal), gauss))


_rng.register("keras_seed_generator", _keras_seed_capture, _keras_seed_restore)
_rng.register("tf_global_generator", _tf_generator_capture, _tf_generator_restore)
_rng.register("tf_op_seeds", _tf_op_seeds_capture, _tf_op_seeds_restore)


# ------------------------------------------------------------------------------------ helpers
def _numpy(v: Any) -> np.ndarray:
    """A Keras variable's value as a NumPy array.

    On the TensorFlow backend this is a view of the variable's buffer, not a copy: the host snapshot
    copies it right away, on this thread, before training goes on. ``Variable.numpy()`` would copy
    every variable once more per save (measured: 0.33 s instead of 15 ms for a 157 MB state).
    """
    read = getattr(getattr(v, "value", None), "read_value", None)
    if read is not None:
        try:
            view = getattr(read(), "_numpy", None)
            if view is not None:
                return view()
        except Exception:  # noqa: BLE001 - a backend without that path: copy instead
            pass
    if hasattr(v, "numpy"):
        return np.asarray(v.numpy())
    return np.asarray(keras.ops.convert_to_numpy(v))


def _fit_locals(model: Any) -> Dict[str, Any]:
    """The local variables of the ``fit`` call that runs the callbacks (its epoch iterator and
    callback list), found by walking up from the callback hook; empty if the layout is unknown."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            break
        loc = frame.f_locals
        if loc.get("self") is model and "epoch_iterator" in loc and "callbacks" in loc:
            return dict(loc)
        frame = frame.f_back
    return {}


def _shape(x: Any) -> tuple:
    return tuple(int(d) for d in x.shape)


class _EpochEnd(keras.callbacks.Callback):
    """Appended last to the fit's callback list: runs the epoch-end save after every other callback
    has updated its state (EarlyStopping placed after DriveCheckpoint included)."""

    def __init__(self, owner: "DriveCheckpoint"):
        super().__init__()
        self.owner = owner

    def on_train_begin(self, logs=None):
        if self.owner._tail is self:  # a tail left behind by a fit that raised stays inert
            self.owner._late_train_begin()

    def on_epoch_end(self, epoch, logs=None):
        if self.owner._tail is self:
            self.owner._epoch_end(epoch)

    def on_train_end(self, logs=None):
        if self.owner._tail is self:
            self.owner._train_end()


class DriveCheckpoint(CheckpointerViews, keras.callbacks.Callback):
    """Checkpoint ``model.fit`` to a local folder, a mounted Drive or any fsspec URL, and resume it.

    Args:
        path: the run folder (``/content/drive/MyDrive/runs/x``, ``gs://b/runs/x``, ...). Default:
            ``$KEEPALIVE_DIR``, else the mounted Drive, else ``./keepalive-checkpoints``, plus ``run``.
        every: ``"epoch"`` (default), an int (optimizer steps) or a duration (``"10min"``). Inside an
            epoch only with :class:`ResumableData`; otherwise a due save waits for the epoch end.
        keep: how many recent checkpoints stay (default 3); ``keep_every``: also keep every Nth.
        on_deadline: ``"save_and_stop"`` (default), ``"save"`` or ``"ignore"`` when the session's
            time limit approaches (see ``keepalive status``).
        track: more callbacks whose state to save (those in the same ``fit`` are found anyway).
        takeover: take the run over from another live session that holds its writer lease.
        background: write checkpoints in a background thread (default).
        spool: ``"auto"`` (default) commits remote / Drive checkpoints to a local spool first and
            uploads them in the background (and switches to it when a local destination fails);
            ``True`` / ``False`` force it. ``flush_timeout``: how long the end of training waits for
            uploads (default 120 s). ``drive_flush``: on Colab, ``drive.flush_and_unmount()`` at the end.
        remaining_fn: seconds left in the session (default: from :mod:`keepalive.session`).
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, *,
                 every: Union[str, int, None] = "epoch", keep: Optional[int] = 3,
                 keep_every: Optional[int] = None, on_deadline: str = "save_and_stop",
                 deadline_margin: Union[str, float, None] = None, run: Optional[str] = None,
                 track: Sequence[Any] = (), takeover: bool = False, background: bool = True,
                 storage_options: Optional[dict] = None, quiet: bool = False,
                 spool: Union[str, bool] = "auto", flush_timeout: Optional[float] = None,
                 drive_flush: Optional[bool] = None,
                 remaining_fn: Optional[Callable[[], Optional[float]]] = None):
        super().__init__()
        self.core = Checkpointer(path, run=run, every=every, keep=keep, keep_every=keep_every,
                                 on_deadline=on_deadline, deadline_margin=deadline_margin,
                                 takeover=takeover, background=background,
                                 storage_options=storage_options, framework="keras", quiet=quiet,
                                 remaining_fn=remaining_fn, spool=spool,
                                 flush_timeout=flush_timeout, drive_flush=drive_flush)
        self.core.metadata["keras"] = {"version": keras.__version__,
                                       "backend": keras.backend.backend()}
        self.track = list(track)
        self.data: Optional[ResumableData] = None
        self._active = False
        self._reset_fit_state()
        _LIVE.add(self)

    def _reset_fit_state(self) -> None:
        self._fit: Dict[str, Any] = {}
        self._callbacks: List[Any] = []
        self._tail: Optional[_EpochEnd] = None
        self._pending: Dict[str, Any] = {}
        self._adapter: Any = None
        self._short_epoch: Optional[int] = None
        self._pass_done = 0
        self._offset = 0
        self._nothing_to_do = False
        self._torch_rng_again: Any = None

    # ------------------------------------------------------------------------------ properties
    @property
    def mid_epoch(self) -> bool:
        """Whether this fit can be checkpointed and resumed inside an epoch (ResumableData)."""
        return self.core.trigger.mid_epoch

    # ---------------------------------------------------------------------------- train begin
    def _abandon(self) -> None:
        """A fit that raised (no on_train_end): release its signal handlers and writer lease."""
        self._active = False
        self._tail = None
        try:
            self.core.close()
        except Exception as exc:  # noqa: BLE001 - cleaning up after someone else's failure
            log.warning("could not close the checkpointer of an interrupted fit: %s", exc)

    def on_train_begin(self, logs=None):
        # fit runs one at a time: an "active" checkpointer now belongs to a fit that raised
        for other in [self, *list(_LIVE)]:
            if other._active:
                other._abandon()
        self._reset_fit_state()
        core = self.core
        core.finished = core.stopped = False
        core.stop_reason = None
        core.trigger.deadline_hit = False
        for k in core.counters:
            core.counters[k] = 0
        self._fit = _fit_locals(self.model)
        epochs = self._epochs()
        core.total_epochs = epochs or None
        self._callbacks = self._find_callbacks()
        self._bind_data()
        model = self.model
        model._initial_epoch = None
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        tree = core.load(describe=self._describe)
        if tree is None:
            first = int(self._fit.get("initial_epoch") or 0)  # fit(initial_epoch=...) of the user
            core.counters["epoch"] = first
            if self.data is not None:
                self.data.plan(first, 0)
        else:
            self._restore(tree, epochs)
        self._install_tail()
        core.install_signal_handlers()
        self._active = True
        if tree is not None and not self._nothing_to_do and core.counters["epoch"] >= epochs:
            self._nothing_to_do = True
            say(f"run '{core.store.run}' already completed {core.counters['epoch']} epoch(s) of "
                f"{epochs}; nothing to do (weights restored)")
        if self._nothing_to_do:
            core.finished = True

    def _epochs(self) -> int:
        """fit(epochs=...): from the callback params, else from fit's own arguments (a CallbackList
        passed to fit gets no params)."""
        value = (self.params or {}).get("epochs") or self._fit.get("epochs") or 0
        return int(value)

    def _find_callbacks(self) -> List[Any]:
        cbl = self._fit.get("callbacks")
        found = list(getattr(cbl, "callbacks", []) or [])
        for cb in self.track:
            if cb not in found:
                found.append(cb)
        return [cb for cb in found if cb is not self and not isinstance(cb, _EpochEnd)]

    def _install_tail(self) -> None:
        cbl = self._fit.get("callbacks")
        lst = getattr(cbl, "callbacks", None)
        if isinstance(lst, list) and self in lst:
            self._tail = _EpochEnd(self)
            self._tail.set_model(self.model)
            self._tail.set_params(self.params or {})
            lst.append(self._tail)  # appending while the list is iterated: it is reached last
        else:
            warnings.warn("keepalive: could not find the callback list of this fit (unknown Keras "
                          "layout); callbacks listed after DriveCheckpoint save their state one "
                          "epoch late. Put DriveCheckpoint last in callbacks=[...].", stacklevel=3)

    def _bind_data(self) -> None:
        """Find the fit's input adapter; with ResumableData, bind each pass to its epoch."""
        self.data = None
        self.core.trigger.mid_epoch = False
        it = self._fit.get("epoch_iterator")
        adapter = getattr(it, "data_adapter", None)
        ds = getattr(adapter, "py_dataset", None)
        if not isinstance(ds, ResumableData):
            return
        if getattr(adapter, "enqueuer", None) is not None or not hasattr(adapter, "_finite_generator") \
                or not hasattr(adapter, "_standardize_batch") or not hasattr(it, "_num_batches"):
            warnings.warn("keepalive: this Keras version iterates ResumableData differently; "
                          "checkpoints at epoch ends only", stacklevel=3)
            return
        if getattr(it, "steps_per_epoch", None):
            warnings.warn("keepalive: fit(steps_per_epoch=...) with ResumableData: checkpoints at "
                          "epoch ends only; leave steps_per_epoch out to resume inside epochs",
                          stacklevel=3)
            return

        def one_pass():
            epoch, start = ds.next_pass()
            for b in range(start, ds.batches_per_epoch):
                yield adapter._standardize_batch(ds.get(epoch, b))

        adapter._finite_generator = one_pass  # per instance: fit's input pipeline calls it per pass
        self._adapter = adapter
        self.data = ds
        self.core.trigger.mid_epoch = True

    # -------------------------------------------------------------------------------- restore
    def _describe(self, tree: Dict[str, Any]) -> str:
        parts = ["weights", "optimizer", "RNG"]
        counters = tree.get("counters", {})
        if counters.get("batch"):
            parts.append(f"data position (batch {counters['batch']} of epoch {counters.get('epoch')})")
        names = sorted({k.split(":")[0] for k in (tree.get("keras", {}).get("callbacks") or {})})
        if names:
            parts.append("state of " + ", ".join(names))
        return "restored " + ", ".join(parts)

    def _restore(self, tree: Dict[str, Any], epochs: int) -> None:
        core, model = self.core, self.model
        objects = tree.get("objects", {})
        mvars, ovars = list(model.variables), list(model.optimizer.variables) if model.optimizer else []
        self._check("model", mvars, objects.get("model"), tree)
        if model.optimizer is not None:
            self._check("optimizer", ovars, objects.get("optimizer"), tree)
        for v, a in zip(mvars, objects["model"]):
            v.assign(np.asarray(a))
        if model.optimizer is not None:
            for v, a in zip(ovars, objects["optimizer"]):
                v.assign(np.asarray(a))
        kstate = tree.get("keras", {}) or {}
        data = tree.get("data", {}) or {}
        epoch, batch = core.counters["epoch"], core.counters["batch"]
        if self.data is not None:
            if data.get("seed") is not None:
                self.data.seed = int(data["seed"])
            if data.get("batches_per_epoch") not in (None, self.data.batches_per_epoch):
                log.warning("the data now has %d batches per epoch, the checkpoint was made with %s",
                            self.data.batches_per_epoch, data.get("batches_per_epoch"))
            if batch >= self.data.batches_per_epoch:  # the data changed size since the save
                say(f"the checkpoint is at batch {batch} of epoch {epoch}, but the data now has "
                    f"{self.data.batches_per_epoch} batches per epoch; epoch {epoch} restarts at its "
                    "first batch")
                batch = 0
            self.data.plan(epoch, batch)
            if batch:
                self._short_epoch = epoch
                self._fit["epoch_iterator"]._num_batches = self.data.batches_per_epoch - batch
                self._set_progbar_target(self.data.batches_per_epoch - batch)
        elif batch:
            say(f"the checkpoint is at batch {batch} of epoch {epoch}, but this fit's data cannot "
                f"start inside an epoch (wrap it in ResumableData); epoch {epoch} restarts at its "
                "first batch")
            batch = 0
        core.counters["batch"] = self._offset = batch
        if self.data is None:
            self._warn_seed(tree.get("rng") or {})
        self._pending = {"metrics": objects.get("metrics") if batch else None,
                         "callbacks": kstate.get("callbacks") or {},
                         "history": kstate.get("history"), "rng": tree.get("rng")}
        start = epoch
        if kstate.get("ended_early"):
            # the run ended early (EarlyStopping or stop_training): running it again does nothing
            self._nothing_to_do = True
            start = max(epochs, epoch)
            say(f"run '{core.store.run}' ended early at epoch {epoch} (e.g. EarlyStopping) and is "
                "complete; nothing to do (weights restored). Use another path or run= to train anew.")
        model._initial_epoch = start

    def _warn_seed(self, saved_rng: Dict[str, Any]) -> None:
        """Keras shuffles plain arrays inside tf.data from TF's global seed, fixed when fit built its
        pipeline (before any callback runs): a resumed run must set the same seed to see the same
        order."""
        adapter = getattr(self._fit.get("epoch_iterator"), "data_adapter", None)
        if type(adapter).__name__ != "ArrayDataAdapter" or not getattr(adapter, "_shuffle", True):
            return
        saved = (saved_rng.get("tf_op_seeds") or {}).get("seed")
        live = _tf_op_seeds_capture()
        live = None if live is None else live["seed"]
        if keras.backend.backend() == "tensorflow" and saved is not None and live != saved:
            say(f"TensorFlow's global seed is {live} here but was {saved} in the run that saved: "
                "Keras' shuffle of plain arrays will not follow the same order. Call "
                f"keras.utils.set_random_seed({saved}) before fit, or use ResumableData")

    def _set_progbar_target(self, steps: int) -> None:
        """The progress bar of a resumed epoch counts the batches it still has (cosmetic)."""
        for cb in self._callbacks:
            if isinstance(cb, keras.callbacks.ProgbarLogger) and getattr(cb, "target", None):
                cb.target = steps

    def _check(self, name: str, live: List[Any], saved: Any, tree: Dict[str, Any]) -> None:
        where = self.core.resumed_from.url if self.core.resumed_from else "?"
        names = (tree.get("keras", {}) or {}).get("names", {}).get(name) or []
        if saved is None:
            raise StateMismatchError(f"checkpoint {where} has no {name} state; nothing was loaded")
        if len(saved) != len(live):
            raise StateMismatchError(
                f"{name}: the checkpoint {where} has {len(saved)} variables, the live {name} "
                f"{len(live)}; the architecture (or the optimizer) differs. Nothing was loaded; use "
                "another path or run= for a new run.")
        for i, (v, a) in enumerate(zip(live, saved)):
            if _shape(v) != _shape(a):
                what = names[i] if i < len(names) else v.path
                raise StateMismatchError(
                    f"{name}: variable {i} ({what}) has shape {_shape(a)} in the checkpoint but "
                    f"{_shape(v)} here; the architecture differs. Nothing was loaded.")

    def _late_train_begin(self) -> None:
        """After every callback's on_train_begin (they reset their state there): restore theirs,
        History's, and the RNGs, as late as possible before the first batch."""
        pending = self._pending
        if not pending:
            return
        states = pending.get("callbacks") or {}
        for key, cb in self._keyed_callbacks().items():
            if key in states:
                self._set_callback_state(cb, states[key])
        hist = pending.get("history")
        history = getattr(self.model, "history", None)
        if hist and isinstance(history, keras.callbacks.History):
            history.epoch = [int(e) for e in hist.get("epoch", [])]
            history.history = {k: list(v) for k, v in (hist.get("history") or {}).items()}
        saved_rng = pending.get("rng")
        if saved_rng:
            _rng.restore(saved_rng)
            if self._offset and keras.backend.backend() == "torch" and "torch_cpu" in saved_rng:
                # The torch backend wraps each pass in a torch DataLoader whose creation draws a seed
                # from torch's global generator. An uninterrupted run made that draw at the start of
                # this epoch, before the state was saved: put the generator back after it.
                self._torch_rng_again = saved_rng["torch_cpu"]
        pending["callbacks"] = pending["history"] = pending["rng"] = None

    # ------------------------------------------------------------------------------- callbacks
    def _keyed_callbacks(self) -> Dict[str, Any]:
        keyed: Dict[str, Any] = {}
        seen: Dict[str, int] = {}
        for cb in self._callbacks:
            if isinstance(cb, (keras.callbacks.History, keras.callbacks.ProgbarLogger)):
                continue
            stateful = any(isinstance(cb, cls) for cls in _CALLBACK_STATE) or (
                hasattr(cb, "state_dict") and hasattr(cb, "load_state_dict"))
            if not stateful:
                continue
            name = type(cb).__name__
            n = seen.get(name, 0)
            seen[name] = n + 1
            keyed[f"{name}:{n}"] = cb
        return keyed

    @staticmethod
    def _callback_state(cb: Any) -> Dict[str, Any]:
        if hasattr(cb, "state_dict") and hasattr(cb, "load_state_dict"):
            return {"state_dict": cb.state_dict()}
        for cls, attrs in _CALLBACK_STATE.items():
            if isinstance(cb, cls):
                out = {}
                for a in attrs:
                    if hasattr(cb, a):
                        v = getattr(cb, a)
                        if isinstance(v, list) and v and hasattr(v[0], "shape"):
                            v = [np.asarray(w) for w in v]
                        out[a] = v
                return out
        return {}

    @staticmethod
    def _set_callback_state(cb: Any, state: Dict[str, Any]) -> None:
        if "state_dict" in state and hasattr(cb, "load_state_dict"):
            cb.load_state_dict(state["state_dict"])
            return
        for a, v in state.items():
            if isinstance(v, list) and v and hasattr(v[0], "shape"):
                v = [np.array(w) for w in v]
            elif isinstance(v, np.ndarray):
                v = np.array(v)
            setattr(cb, a, v)

    # ---------------------------------------------------------------------------------- loop
    def on_epoch_begin(self, epoch, logs=None):
        if not self._active:
            return
        if self._tail is None:
            self._late_train_begin()
        self.model._initial_epoch = None  # read by fit already; never leak into a later fit
        self.core.counters["epoch"] = int(epoch)
        self.core.trigger.start_epoch()
        self._pass_done = 0
        metrics = self._pending.pop("metrics", None) if self._pending else None
        if metrics is not None:  # after fit's reset_metrics(): the resumed epoch's running means
            live = list(self.model.metrics_variables)
            if len(live) == len(metrics) and all(_shape(v) == _shape(a) for v, a in zip(live, metrics)):
                for v, a in zip(live, metrics):
                    v.assign(np.asarray(a))
            else:
                log.warning("the compiled metrics differ from the checkpoint's; epoch %d's logged "
                            "metrics cover only the batches after the resume", epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self._torch_rng_again is not None:
            import torch

            torch.set_rng_state(torch.as_tensor(np.asarray(self._torch_rng_again)).clone()
                                if not isinstance(self._torch_rng_again, torch.Tensor)
                                else self._torch_rng_again.clone())
            self._torch_rng_again = None

    def on_train_batch_end(self, batch, logs=None):
        if not self._active:
            return
        core = self.core
        done = int(batch) + 1  # batches done in this pass (batch = last step of the execution)
        n = max(0, done - self._pass_done)
        self._pass_done = done
        b0 = core.counters["batch"]
        core.counters["batch"] = self._offset + done
        core.counters["step"] += n
        core.counters["samples"] += self._samples(b0, n)
        if self.data is not None and core.counters["batch"] >= self.data.batches_per_epoch:
            # The epoch's last batch: its end (validation, other callbacks) has not run yet, and a
            # resume cannot replay an epoch end without batches. A save or a deadline stop due here
            # is carried out at the epoch end (the core defers both).
            core.step_boundary(self._capture, can_save=False, steps=n)
            return
        decision = core.step_boundary(self._capture, can_save=core.trigger.mid_epoch, steps=n)
        if decision.stop:
            self.model.stop_training = True

    def _samples(self, first: int, n: int) -> int:
        if self.data is not None:
            return sum(self.data.samples_in(b) for b in range(first, first + n)
                       if b < self.data.batches_per_epoch)
        adapter = getattr(self._fit.get("epoch_iterator"), "data_adapter", None)
        try:
            bs, nb = adapter.batch_size, adapter.num_batches
            if not bs:
                return 0
            last = adapter.partial_batch_size if adapter.has_partial_batch else bs
            return sum(last if nb and b == nb - 1 else bs for b in range(first, first + n))
        except Exception:  # noqa: BLE001 - an estimate only
            return 0

    def on_epoch_end(self, epoch, logs=None):
        if self._tail is None:  # no tail installed: do the epoch end here
            self._epoch_end(epoch)

    def _epoch_end(self, epoch: int) -> None:
        core = self.core
        if not self._active or core.stopped:  # stopped inside this epoch: it is not complete
            return
        core.counters["epoch"] = int(epoch) + 1
        core.counters["batch"] = self._offset = 0
        if self._short_epoch is not None:
            self._fit["epoch_iterator"]._num_batches = self.data.batches_per_epoch
            self._set_progbar_target(self.data.batches_per_epoch)
            self._short_epoch = None
        epochs = self._epochs()
        last = core.counters["epoch"] >= epochs or bool(self.model.stop_training)
        decision = core.epoch_boundary(self._capture, last=last)
        if decision.stop:
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self._tail is None:
            self._train_end()

    def _train_end(self) -> None:
        if not self._active:
            return
        self._active = False
        core = self.core
        try:
            if not core.finished and not core.stopped:
                # fit ended without our last-epoch marker (e.g. stopped by a callback after us)
                core.epoch_boundary(self._capture, last=True)
        finally:
            self.model._initial_epoch = None
            if self._adapter is not None:
                self._adapter.__dict__.pop("_finite_generator", None)
                self._adapter = None
            cbl = self._fit.get("callbacks")
            lst = getattr(cbl, "callbacks", None)
            if self._tail is not None and isinstance(lst, list) and self._tail in lst:
                lst.remove(self._tail)
            self._tail = None
            self._fit = {}
            core.close()

    # ------------------------------------------------------------------------------- capture
    def _capture(self) -> Dict[str, Any]:
        model = self.model
        opt = model.optimizer
        mvars = list(model.variables)
        ovars = list(opt.variables) if opt is not None else []
        history = getattr(model, "history", None)
        hist = None
        if isinstance(history, keras.callbacks.History):
            hist = {"epoch": [int(e) for e in history.epoch],
                    "history": {k: [float(x) for x in v] for k, v in history.history.items()}}
        tree = {
            "objects": {"model": [_numpy(v) for v in mvars],
                        "optimizer": [_numpy(v) for v in ovars],
                        "metrics": [_numpy(v) for v in model.metrics_variables]},
            "keras": {"names": {"model": [v.path for v in mvars], "optimizer": [v.path for v in ovars]},
                      "callbacks": {k: self._callback_state(cb) for k, cb in self._keyed_callbacks().items()},
                      "history": hist, "finished": bool(self.core.finished),
                      "ended_early": bool(self.core.finished and self.core.counters["epoch"] < self._epochs()),
                      "epochs": self._epochs(),
                      "backend": keras.backend.backend()},
            "data": {"kind": "resumable" if self.data is not None else "keras"},
        }
        if self.data is not None:
            tree["data"].update(seed=self.data.seed, batches_per_epoch=self.data.batches_per_epoch)
        return tree

    # ------------------------------------------------------------------------------- by hand
    def save(self, *, sync: bool = False) -> None:
        """Save now (in the background unless ``sync``); inside an epoch only with ResumableData."""
        self.core.save(self._capture, sync=sync, reason="by hand")

    def flush(self, timeout: Optional[float] = None) -> None:
        self.core.flush(timeout)

    def close(self) -> None:
        self.core.close()
