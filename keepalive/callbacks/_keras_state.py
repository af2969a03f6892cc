"""Keras / TensorFlow state that :class:`keepalive.callbacks.keras.DriveCheckpoint` saves besides the
variables: the framework RNGs (registered with :mod:`keepalive.rng` on import), the state of the
stateful callbacks, ``History``, and the few ways to read / write variables and reach ``fit``'s locals.

Why a module of its own: none of this is a hook of the adapter; it is what the hooks capture and
restore, and it knows Keras internals (``keras.src`` globals, TensorFlow's eager context) that the
adapter should not have to spell out.

Not restorable: TF1-style unseeded random ops inside ``tf.function`` / ``tf.data`` graphs
(``tf.random.uniform`` without a seed) keep their position in TensorFlow kernels no library can read;
Keras' own layers use ``SeedGenerator`` states, which are restored.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import keras
import numpy as np

from .. import plan, rng
from ..adapter import check_fits
from ..errors import StateMismatchError
from . import _compat_keras as kc

__all__ = ["CALLBACK_STATE", "assign", "assign_if_fits", "callback_state", "callback_states", "capture_tree",
           "describe",
           "ensure_built", "fit_locals", "history_state", "keyed_callbacks", "learning_rate_plan", "load_start",
           "load_variables", "optimizer_steps", "replay_last_logs", "set_learning_rate", "state_fingerprint",
           "restore_callback_states", "restore_history", "restore_metrics", "seed_mismatch",
           "set_callback_state", "set_torch_rng", "stage_of", "tf_global_seed", "variable_array", "weights_checksum"]


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


rng.register("keras_seed_generator", _keras_seed_capture, _keras_seed_restore)
rng.register("tf_global_generator", _tf_generator_capture, _tf_generator_restore)
rng.register("tf_op_seeds", _tf_op_seeds_capture, _tf_op_seeds_restore)


def tf_global_seed() -> Optional[int]:
    """TensorFlow's global seed here (``keras.utils.set_random_seed``), None when unset / no TF."""
    live = _tf_op_seeds_capture()
    return None if live is None else live["seed"]


def seed_mismatch(iterator: Any, saved_rng: Dict[str, Any]) -> Optional[str]:
    """Keras shuffles plain arrays inside tf.data from TF's global seed, fixed when fit built its
    pipeline (before any callback runs): a resumed run must set the same seed to see the same order.
    The problem in words when it does not, else None."""
    adapter = getattr(iterator, "data_adapter", None)
    if type(adapter).__name__ != "ArrayDataAdapter" or not getattr(adapter, "_shuffle", True):
        return None
    saved, live = (saved_rng.get("tf_op_seeds") or {}).get("seed"), tf_global_seed()
    if keras.backend.backend() != "tensorflow" or saved is None or live == saved:
        return None
    return (f"TensorFlow's global seed is {live} here but was {saved} in the run that saved: Keras' "
            f"shuffle of plain arrays will not follow the same order. Call "
            f"keras.utils.set_random_seed({saved}) before fit, or use ResumableData")


def set_torch_rng(state: Any) -> None:
    """Put torch's global generator (Keras torch backend) back to a saved state."""
    import torch

    torch.set_rng_state(state.clone() if isinstance(state, torch.Tensor)
                        else torch.as_tensor(np.asarray(state)).clone())


# ---------------------------------------------------------------------------------- variables
def variable_array(v: Any) -> np.ndarray:
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


def assign(variables: Sequence[Any], arrays: Sequence[Any]) -> None:
    """Load saved arrays into variables (already checked to fit)."""
    for v, a in zip(variables, arrays):
        v.assign(np.asarray(a))


def restore_metrics(model: Any, saved: Sequence[Any]) -> bool:
    """Load saved metric variables (a resumed epoch's running means); False when they do not fit
    the compiled metrics (then nothing is loaded)."""
    return assign_if_fits(model.metrics_variables, saved)


def load_variables(model: Any, tree: Mapping[str, Any], where: str) -> None:
    """Load a checkpoint's model and optimizer variables, after checking that every saved variable
    fits its live one (else StateMismatchError, and nothing is loaded)."""
    objects, names = tree.get("objects", {}), (tree.get("keras") or {}).get("names") or {}
    pairs = [("model", list(model.variables))]
    if model.optimizer is not None:
        pairs.append(("optimizer", list(model.optimizer.variables)))
    for name, live in pairs:
        if objects.get(name) is None:
            raise StateMismatchError(f"checkpoint {where} has no {name} state; nothing was loaded")
        check_fits(name, live, objects[name], where=where, lacks="the architecture (or the optimizer) "
                   "differs", names=names.get(name) or [v.path for v in live])
    for name, live in pairs:
        assign(live, objects[name])


def assign_if_fits(variables: Sequence[Any], saved: Any) -> bool:
    """Load saved arrays into variables when they fit (else nothing); whether they were loaded."""
    live = list(variables)
    try:
        check_fits("state", live, saved, where="")
    except StateMismatchError:
        return False
    assign(live, saved)
    return True


def load_start(model: Any, tree: Mapping[str, Any], optimizer: bool) -> None:
    """An earlier stage's end state as the start of a new one: the model's variables, and with
    ``optimizer`` (the stage goes on with the same optimizer: not recompiled) the optimizer's, each
    only where it fits. A recompiled optimizer keeps its fresh state, as in a run never interrupted."""
    objects = tree.get("objects") or {}
    assign_if_fits(model.variables, objects.get("model"))
    if optimizer and model.optimizer is not None:
        assign_if_fits(model.optimizer.variables, objects.get("optimizer"))


def optimizer_steps(optimizer: Any) -> int:
    """The steps an optimizer has taken (its ``iterations``); 0 for none."""
    iterations = getattr(optimizer, "iterations", None)
    return 0 if iterations is None else int(keras.ops.convert_to_numpy(iterations))


def learning_rate_plan(optimizer: Any) -> Any:
    """The learning rate an optimizer was built with, as a plan value (:mod:`keepalive.plan`): a number
    (7 significant digits: the float32 variable's 0.009999999776 is the code's 0.01), a schedule's class
    and config, or a callable's name (its ``repr`` names an address that differs in every process)."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer: the one it wraps
    lr = getattr(optimizer, "_learning_rate", None)
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        try:
            config = lr.get_config()
        except Exception:  # noqa: BLE001 - a user schedule without get_config: its class alone
            config = {}
        return {"schedule": type(lr).__name__, **plan.plain(config)}
    if callable(lr) and not hasattr(lr, "assign"):
        return f"callable {getattr(lr, '__qualname__', type(lr).__name__)}"
    try:
        return float(f"{float(keras.ops.convert_to_numpy(optimizer.learning_rate)):.7g}")
    except (TypeError, ValueError):
        return None


def set_learning_rate(optimizer: Any, value: Any) -> bool:
    """Set a number as the optimizer's learning rate (held in a variable the checkpoint restored);
    False when the optimizer's learning rate is a schedule or a callable (the code's is used anyway)."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer: the one it wraps
    if not isinstance(value, (int, float)) or not hasattr(getattr(optimizer, "_learning_rate", None), "assign"):
        return False
    optimizer.learning_rate = float(value)
    return True


def _unbuilt(model: Any) -> bool:
    metrics, loss, opt = (getattr(model, a, None) for a in ("_compile_metrics", "_compile_loss", "optimizer"))
    return (not all(layer.built for layer in model._flatten_layers())
            or any(m is not None and not m.built for m in (metrics, loss, opt)))


def _one_sample(batch: Any) -> Any:
    """A batch of one sample: sliced from arrays, zeros for symbolic shapes (tf.data specs)."""
    def one(a: Any) -> Any:
        if a is None:
            return None
        if isinstance(a, keras.KerasTensor):
            return np.zeros((1,) + tuple(d or 1 for d in a.shape[1:]), dtype=a.dtype)
        return a[:1]

    batch = tuple(batch) if isinstance(batch, list) else batch
    return keras.tree.map_structure(one, batch)


def ensure_built(model: Any, batch: Any) -> Optional[str]:
    """Build the model, its compiled metrics / loss and its optimizer now, from one input batch (or
    its shapes), as Keras would in the first step: a checkpoint is loaded into these variables before
    that step. Returns a problem (for a warning) when the model cannot be built here."""
    if not _unbuilt(model):
        return None
    if batch is not None:
        try:
            if not all(layer.built for layer in model._flatten_layers()):
                # Eagerly, on one sample (inference: no RNG drawn, no statistics updated). Not
                # symbolically: on TensorFlow that creates a frozen layer's variables as untrainable
                # tf.Variables, which stay untrainable after an unfreeze (no gradients, silently).
                x, _, _ = keras.utils.unpack_x_y_sample_weight(_one_sample(batch))
                model(x, training=False)
            model._symbolic_build(data_batch=batch)  # compiled metrics, loss and the optimizer
            return None
        except Exception as exc:  # noqa: BLE001 - said below; Keras builds it in the first step
            reason = f"building it from the first batch's shapes failed ({exc})"
    else:
        reason = "its input shapes cannot be read from this fit's input without consuming a batch"
    if all(layer.built for layer in model._flatten_layers()):
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        return None  # only compiled metrics unbuilt: their running means restart at a resume
    return (f"the model is not built before its first step and {reason}: a checkpoint cannot be "
            "loaded into it. Give it an input shape (keras.Input(...), model.build(shape)) or call it "
            "on a batch before fit.")


def _fit_frame_locals(model: Any) -> Dict[str, Any]:
    """The local variables of the ``fit`` call that runs the callbacks, found by walking up from the
    callback hook to the frame whose ``self`` is the model; empty if the layout is unknown."""
    names = kc.FIT_LOCALS
    frame: Any = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            break
        loc = frame.f_locals
        if loc.get("self") is model and names["iterator"] in loc and names["callbacks"] in loc:
            return dict(loc)
        frame = frame.f_back
    return {}


def fit_locals(model: Any) -> Dict[str, Any]:
    """The local variables of the ``fit`` call that runs the callbacks (``iterator``, ``callbacks``,
    ``epochs``, ``initial_epoch``: :data:`kc.FIT_LOCALS` names them in Keras); empty if the layout is
    unknown."""
    loc = _fit_frame_locals(model)
    return {key: loc.get(name) for key, name in kc.FIT_LOCALS.items()} if loc else {}


def replay_last_logs(model: Any, saved: Mapping[str, Any]) -> bool:
    """An epoch resumed after all its batches (saved during its validation) trains no batch, so
    ``fit`` would take the epoch's logs from an empty dict: put the last batch's logs (saved) into
    the dict ``fit`` holds (the same object: filled in place), from which it computes the epoch's
    logs as in the run that saved (the model's metrics when the keys match, restored). False when
    ``fit``'s logs cannot be reached (then the epoch's training logs are missing)."""
    logs = _fit_frame_locals(model).get("logs")
    if not isinstance(logs, dict) or logs:
        return False
    logs.update(saved)
    return True


def _token(value: Any) -> Any:
    """A cheap, comparable stand-in for a callback attribute: a scalar's repr (NaN equals NaN), else
    the object's identity (a list of best weights is replaced, not changed in place)."""
    if value is None or isinstance(value, (bool, int, float, str, np.generic)):
        return repr(value)
    return (type(value).__name__, id(value))


def weights_checksum(model: Any) -> Tuple[str, ...]:
    """One sum per model variable (on its device, then a scalar each to the host): what tells, on
    backends without version counters (TensorFlow, JAX), that code between two training steps changed
    the weights in place (``SwapEMAWeights`` puts the EMA weights into the model for the validation).
    Costs one small reduction per variable: taken once per epoch (after its last batch) and when a
    save during the validation is about to be made, not at every step."""
    dtype = _widest_float()
    return tuple(repr(float(keras.ops.convert_to_numpy(keras.ops.sum(keras.ops.cast(v.value, dtype)))))
                 for v in model.variables)


def _widest_float() -> str:
    """The sums' dtype: float64, except on JAX without ``jax_enable_x64`` (its default), which would
    cast to float32 anyway and print a UserWarning about it on the user's screen."""
    if keras.backend.backend() == "jax":
        import jax

        if not jax.config.read("jax_enable_x64"):
            return "float32"
    return "float64"


def state_fingerprint(model: Any, callbacks: Sequence[Any]) -> Tuple[Any, ...]:
    """What a checkpoint reads beside the variables' values that code between two training steps
    (a callback's ``on_test_begin``) may change, cheaply (read at every step boundary): the
    optimizer's iterations and learning-rate variable, on the torch backend the version counters of
    the model's and the optimizer's tensors (an in-place change), and the stateful callbacks' state.
    TensorFlow and JAX variables have no version counter: a weight that code between steps changes
    in place is not seen there."""
    opt = model.optimizer
    parts: list = [optimizer_steps(opt) if opt is not None else 0]
    inner = getattr(opt, "inner_optimizer", opt)
    lr = getattr(inner, "_learning_rate", None)
    parts.append(repr(variable_array(lr).item()) if hasattr(lr, "assign") else None)
    if keras.backend.backend() == "torch":
        variables = list(model.variables) + (list(opt.variables) if opt is not None else [])
        parts.append(sum(int(getattr(getattr(v, "value", None), "_version", 0)) for v in variables))
    for key, cb in keyed_callbacks(callbacks).items():
        if _has_state_dict(cb):
            state = cb.state_dict()
            parts.append((key, tuple((k, _token(v)) for k, v in sorted(state.items())) if isinstance(state, dict)
                          else _token(state)))
            continue
        for cls, attrs in CALLBACK_STATE.items():
            if isinstance(cb, cls):
                parts.append((key, tuple(_token(getattr(cb, a, None)) for a in attrs)))
    return tuple(parts)


# ---------------------------------------------------------------------------------- callbacks
#: the attributes that make up the state of Keras' stateful callbacks (subclasses included)
CALLBACK_STATE = kc.CALLBACK_STATE


def _csv_text(cb: Any) -> str:
    """What a CSVLogger has written so far (it flushes after every epoch)."""
    from keras.src.utils import file_utils

    if not file_utils.exists(cb.filename):
        return ""
    with file_utils.File(cb.filename, "r") as f:
        return f.read()


def _csv_restore(cb: Any, text: str) -> None:
    """Make a CSVLogger's file hold the saved epochs' lines and continue after them: with
    ``append=False`` it truncated its file at the start of fit, with ``append=True`` it may hold lines
    of epochs that ran after the checkpoint (they run again)."""
    f = getattr(cb, "csv_file", None)
    if f is None or f.closed:
        return
    f.seek(0)
    f.truncate()
    f.write(text)
    f.flush()
    cb.append_header = not text


def _has_state_dict(cb: Any) -> bool:
    return hasattr(cb, "state_dict") and hasattr(cb, "load_state_dict")


def keyed_callbacks(callbacks: Sequence[Any]) -> Dict[str, Any]:
    """The stateful callbacks by key (``"EarlyStopping:0"``): stable across runs of the same code."""
    keyed: Dict[str, Any] = {}
    seen: Dict[str, int] = {}
    for cb in callbacks:
        if isinstance(cb, (keras.callbacks.History, keras.callbacks.ProgbarLogger)):
            continue
        if not (any(isinstance(cb, cls) for cls in CALLBACK_STATE) or _has_state_dict(cb)
                or isinstance(cb, keras.callbacks.CSVLogger)):
            continue
        name = type(cb).__name__
        n = seen.get(name, 0)
        seen[name] = n + 1
        keyed[f"{name}:{n}"] = cb
    return keyed


def callback_state(cb: Any) -> Dict[str, Any]:
    """A callback's state: its ``state_dict()``, else the attributes of :data:`CALLBACK_STATE`."""
    if _has_state_dict(cb):
        return {"state_dict": cb.state_dict()}
    if isinstance(cb, keras.callbacks.CSVLogger):
        return {"csv_text": _csv_text(cb)}
    for cls, attrs in CALLBACK_STATE.items():
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


def set_callback_state(cb: Any, state: Dict[str, Any]) -> None:
    """The inverse of :func:`callback_state` (arrays copied: loaded ones are read-only views)."""
    if "state_dict" in state and hasattr(cb, "load_state_dict"):
        cb.load_state_dict(state["state_dict"])
        return
    if "csv_text" in state:
        _csv_restore(cb, str(state["csv_text"]))
        return
    for a, v in state.items():
        if isinstance(v, list) and v and hasattr(v[0], "shape"):
            v = [np.array(w) for w in v]
        elif isinstance(v, np.ndarray):
            v = np.array(v)
        setattr(cb, a, v)


def callback_states(callbacks: Sequence[Any]) -> Dict[str, Dict[str, Any]]:
    """The state of every stateful callback among ``callbacks``, by key."""
    return {key: callback_state(cb) for key, cb in keyed_callbacks(callbacks).items()}


def restore_callback_states(callbacks: Sequence[Any], states: Dict[str, Dict[str, Any]]) -> None:
    """The inverse of :func:`callback_states` (callbacks without a saved state are left as they are)."""
    for key, cb in keyed_callbacks(callbacks).items():
        if key in states:
            set_callback_state(cb, states[key])


def history_state(model: Any) -> Optional[Dict[str, Any]]:
    """``model.history`` (epochs and logged values), so that a resumed fit's History lists all epochs."""
    history = getattr(model, "history", None)
    if not isinstance(history, keras.callbacks.History):
        return None
    return {"epoch": [int(e) for e in history.epoch],
            "history": {k: [float(x) for x in v] for k, v in history.history.items()}}


def restore_history(model: Any, saved: Optional[Dict[str, Any]]) -> None:
    history = getattr(model, "history", None)
    if saved and isinstance(history, keras.callbacks.History):
        history.epoch = [int(e) for e in saved.get("epoch", [])]
        history.history = {k: list(v) for k, v in (saved.get("history") or {}).items()}

def capture_tree(model: Any, callbacks: Sequence[Any], *, epochs: int, finished: bool, ended_early: bool,
                 stage: Dict[str, int], stages: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The Keras part of a checkpoint: variables (views, copied by the host snapshot), callback states,
    History, and which fit (stage) of the run it is in (see :func:`stage_of`)."""
    opt = model.optimizer
    mvars, ovars = list(model.variables), list(opt.variables) if opt is not None else []
    return {
        "objects": {"model": [variable_array(v) for v in mvars],
                    "optimizer": [variable_array(v) for v in ovars],
                    "metrics": [variable_array(v) for v in model.metrics_variables]},
        "keras": {"names": {"model": [v.path for v in mvars], "optimizer": [v.path for v in ovars]},
                  "callbacks": callback_states(callbacks), "history": history_state(model),
                  "finished": bool(finished), "ended_early": bool(finished and ended_early),
                  "epochs": epochs, "backend": keras.backend.backend(), "stages": list(stages),
                  "stage": dict(stage)},
    }


def stage_of(tree: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """Which ``fit`` of the run (stage) a checkpoint belongs to and where that stage began:
    ``{"index", "epoch_base", "step_base", "done"}`` (checkpoints from before stages: stage 0)."""
    keras_part = (tree or {}).get("keras") or {}
    st = dict(keras_part.get("stage") or {})
    return {"index": int(st.get("index", 0)), "epoch_base": int(st.get("epoch_base", 0)),
            "step_base": int(st.get("step_base", 0)), "done": bool(keras_part.get("finished"))}


def describe(tree: Mapping[str, Any]) -> str:
    """What a resume restores, for the "resuming run ..." line."""
    parts = ["weights", "optimizer", "RNG"]
    counters = tree.get("counters", {})
    if counters.get("batch"):
        parts.append("data position")  # where it lies is in the line already (keepalive.runs.position)
    names = sorted({k.split(":")[0] for k in (tree.get("keras", {}).get("callbacks") or {})})
    if names:
        parts.append("state of " + ", ".join(names))
    return "restored " + ", ".join(parts)
