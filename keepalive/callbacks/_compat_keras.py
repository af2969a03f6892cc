"""The Keras (and TensorFlow) internals the Keras adapter relies on (``keras.py``, ``_keras_state.py``,
``_keras_data.py``), and their check (:mod:`keepalive.callbacks._compat`).

Tested with Keras 3.15 on TensorFlow 2.21 and on the torch backend. The range starts at Keras 3.13, the
first release that names its global seed generator's slot (``GLOBAL_SEED_GENERATOR``, restored with
the RNGs); the other names below exist since 3.6. TensorFlow's internals are checked only when
TensorFlow is imported (the TensorFlow backend), as the adapter only uses them then.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import keras

from ._compat import Framework, Internal, Package, has, local, param, uses

__all__ = ["ARRAY_PASS", "COMPAT", "INTERNALS", "FIT_LOCALS", "FINITE_GENERATOR", "CALLBACK_STATE"]

#: the local variables of the running ``fit`` the callback reads (its key -> Keras' name): found by
#: walking up from a callback hook to the frame whose ``self`` is the model
FIT_LOCALS = {"iterator": "epoch_iterator", "callbacks": "callbacks", "epochs": "epochs",
              "initial_epoch": "initial_epoch"}
#: the method of Keras' PyDataset adapter that yields one pass: replaced on the instance for ResumableData
FINITE_GENERATOR = "_finite_generator"
#: the method of Keras' array adapter that yields one pass on the JAX / NumPy path (its order drawn from
#: NumPy's global generator at the first batch): replaced on the instance for one resumed pass
ARRAY_PASS = "_get_iterator"
#: the attributes that make up the state of Keras' stateful callbacks (subclasses included)
CALLBACK_STATE: Dict[Any, Tuple[str, ...]] = {
    keras.callbacks.EarlyStopping: ("wait", "stopped_epoch", "best", "best_epoch", "best_weights"),
    keras.callbacks.ReduceLROnPlateau: ("wait", "cooldown_counter", "best"),
    keras.callbacks.ModelCheckpoint: ("best", "_current_epoch", "_batches_seen_since_last_saving",
                                      "_last_batch_seen"),
}

_ADAPTERS = {"ArrayDataAdapter": "array_data_adapter", "TFDatasetAdapter": "tf_dataset_adapter",
             "GeneratorDataAdapter": "generator_data_adapter", "PyDatasetAdapter": "py_dataset_adapter"}


_DATA = "keras.src.trainers.data_adapters"
_ITER = "keras.src.trainers.epoch_iterator:EpochIterator"
_TF_CONTEXT = "tensorflow.python.eager.context:Context"
_K, _S, _D = "keras.py", "_keras_state.py", "_keras_data.py"
_TF = "tensorflow"


def _adapter(name: str) -> str:
    """A Keras data adapter class (compared by name in ``_keras_data``), as a check names it."""
    return f"{_DATA}.{_ADAPTERS[name]}:{name}"


#: the internals, as a table: name, what the adapter does with it, where, the check
INTERNALS = (
    *(Internal(f"Model.fit local '{name}'", "read from the running fit's frame (walked up to from a "
               "callback hook)", f"{_S}: fit_locals", local("keras:Model.fit", "self", name), token="FIT_LOCALS")
      for name in FIT_LOCALS.values()),
    Internal("Model._initial_epoch", "read by fit before its first epoch: set to skip finished epochs",
             f"{_K}: DriveCheckpoint._restore, _begin_stage", uses("keras:Model.fit", "_initial_epoch")),
    Internal("Optimizer._learning_rate", "the learning rate an optimizer was built with (a variable, a "
             "schedule or a callable): the fit's plan, and the code's rate set after a resume",
             f"{_S}: learning_rate_plan, set_learning_rate", uses("keras:optimizers.Optimizer", "_learning_rate"),
             token='"_learning_rate"'),
    Internal("CallbackList.callbacks", "the fit's callback list: the epoch-end tail is appended to it",
             f"{_K}: DriveCheckpoint._install_tail", uses("keras:callbacks.CallbackList", "callbacks"),
             token='"callbacks", None)'),
    Internal("Layer._flatten_layers", "whether every layer is built", f"{_S}: ensure_built",
             has("keras:Model", "_flatten_layers")),
    Internal("Model._symbolic_build(data_batch=)", "builds compiled metrics, loss and optimizer before the "
             "first step (the checkpoint loads into them)", f"{_S}: ensure_built",
             param("keras:Model._symbolic_build", "data_batch"), token="_symbolic_build(data_batch="),
    Internal("Model._compile_metrics", "whether the compiled metrics are built", f"{_S}: _unbuilt",
             uses("keras:Model", "_compile_metrics"), token='"_compile_metrics"'),
    Internal("Model._compile_loss", "whether the compiled loss is built", f"{_S}: _unbuilt",
             uses("keras:Model", "_compile_loss"), token='"_compile_loss"'),
    Internal("keras.src.backend.common.global_state.get_global_attribute / set_global_attribute",
             "reach the Keras global SeedGenerator (saved, restored)", f"{_S}: _keras_seed_capture",
             has("keras.src.backend.common.global_state", "get_global_attribute", "set_global_attribute"),
             token="global_state.set_global_attribute"),
    Internal("keras.src.random.seed_generator.GLOBAL_SEED_GENERATOR", "the global SeedGenerator's slot",
             f"{_S}: _keras_seed_capture", has("keras.src.random.seed_generator", "GLOBAL_SEED_GENERATOR")),
    Internal("keras.src.random.seed_generator.global_seed_generator", "creates the global SeedGenerator at a "
             "restore", f"{_S}: _keras_seed_restore", has("keras.src.random.seed_generator", "global_seed_generator")),
    Internal("keras.src.utils.file_utils.exists / File", "read a CSVLogger's file (saved with the checkpoint)",
             f"{_S}: _csv_text", has("keras.src.utils.file_utils", "exists", "File"), token="file_utils.File"),
    Internal("CSVLogger.csv_file", "the open file a resume rewrites", f"{_S}: _csv_restore",
             uses("keras:callbacks.CSVLogger", "csv_file"), token='"csv_file"'),
    Internal("CSVLogger.append_header", "whether the next write starts with the header", f"{_S}: _csv_restore",
             uses("keras:callbacks.CSVLogger", "append_header"), token="cb.append_header"),
    Internal("ProgbarLogger.target", "the progress bar's length in a resumed, shorter epoch (display only)",
             f"{_D}: set_epoch_length", uses("keras:callbacks.ProgbarLogger", "target"), token="cb.target",
             required=False),
    Internal("EpochIterator.data_adapter", "the fit's input, to recognise ResumableData and the input kind",
             f"{_D}: bind_passes, sample_batch", uses(_ITER, "data_adapter"), token='"data_adapter"'),
    Internal("EpochIterator._enumerate_iterator", "replaced on one iterator to give a pass with no batch left "
             "(an epoch resumed after all its training batches: its validation and its end run once)",
             f"{_D}: skip_pass", has(_ITER, "_enumerate_iterator"), token="_enumerate_iterator"),
    Internal("EpochIterator._num_batches", "the number of batches of a pass (a resumed epoch has fewer)",
             f"{_D}: set_epoch_length, pass_length", uses(_ITER, "_num_batches")),
    Internal("EpochIterator.steps_per_epoch", "fit(steps_per_epoch=...) (then: epoch-end saves)",
             f"{_D}: bind_passes, pass_length", uses(_ITER, "steps_per_epoch"), token='"steps_per_epoch"'),
    Internal(f"PyDatasetAdapter.{FINITE_GENERATOR}", "replaced on the instance: each pass of ResumableData "
             "yields its epoch from the planned batch (without it: epoch-end saves, said once)",
             f"{_D}: bind_passes", has(_adapter("PyDatasetAdapter"), FINITE_GENERATOR), token="FINITE_GENERATOR",
             required=False),
    Internal("EpochIterator._current_iterator / _steps_seen / _get_iterator", "the pass fit(steps_per_epoch=...) "
             "keeps across epochs and how far it went (saved; a resume continues it)",
             f"{_D}: PassPosition", uses(_ITER, "_current_iterator", "_steps_seen"), token="_steps_seen"),
    Internal(f"ArrayDataAdapter.{ARRAY_PASS}", "one pass over arrays on JAX (its permutation drawn at the "
             "first batch): a resumed pass skips batches by index (without it: the batches are drawn)",
             f"{_D}: PassPosition._skip_by_index", has(_adapter("ArrayDataAdapter"), ARRAY_PASS),
             token="kc.ARRAY_PASS", required=False),
    Internal("PyDatasetAdapter._standardize_batch", "what Keras does to each batch of a pass (without it: "
             "epoch-end saves, said once)", f"{_D}: bind_passes",
             has(_adapter("PyDatasetAdapter"), "_standardize_batch"), required=False),
    Internal("PyDatasetAdapter.py_dataset", "the PyDataset fit iterates (is it ResumableData)", f"{_D}: bind_passes",
             uses(_adapter("PyDatasetAdapter"), "py_dataset"), token='"py_dataset"'),
    Internal("PyDatasetAdapter.enqueuer", "worker threads / processes (then: epoch-end saves)", f"{_D}: bind_passes",
             uses(_adapter("PyDatasetAdapter"), "enqueuer"), token='"enqueuer"'),
    Internal("PyDatasetAdapter.shuffle", "a shuffled PyDataset (then: an inexact resume, said once)",
             f"{_D}: inexact_input", uses(_adapter("PyDatasetAdapter"), "shuffle"), token='"shuffle"'),
    Internal("ArrayDataAdapter._inputs", "the arrays, to peek at one batch without drawing from the pipeline",
             f"{_D}: sample_batch", uses(_adapter("ArrayDataAdapter"), "_inputs"), token="adapter._inputs"),
    Internal("ArrayDataAdapter._shuffle", "whether plain arrays are shuffled (TF seed check)",
             f"{_S}: seed_mismatch", uses(_adapter("ArrayDataAdapter"), "_shuffle"), token='"_shuffle"'),
    Internal("TFDatasetAdapter._dataset", "the tf.data.Dataset's element spec (to build the model)",
             f"{_D}: sample_batch", uses(_adapter("TFDatasetAdapter"), "_dataset"), token="adapter._dataset"),
    Internal("GeneratorDataAdapter._first_batches", "the batch Keras peeked at already (to build the model)",
             f"{_D}: sample_batch", uses(_adapter("GeneratorDataAdapter"), "_first_batches"),
             token='"_first_batches"'),
    Internal("tensorflow.python.ops.stateful_random_ops.global_generator", "TensorFlow's global "
             "tf.random.Generator (saved)", f"{_S}: _tf_generator_capture",
             has("tensorflow.python.ops.stateful_random_ops", "global_generator"),
             token="stateful_random_ops.global_generator", package=_TF),
    Internal("tensorflow.python.eager.context.Context._seed / _rng", "TensorFlow's global seed and eager "
             "op-seed sequence (saved, restored)", f"{_S}: _tf_op_seeds_capture",
             uses(_TF_CONTEXT, "_seed", "_rng"), token="ctx._rng", package=_TF),
    Internal("tensorflow.python.eager.context.Context._set_global_seed", "sets the global seed at a restore",
             f"{_S}: _tf_op_seeds_restore", has(_TF_CONTEXT, "_set_global_seed"), package=_TF),
    Internal("tensorflow.data.Dataset._variant_tensor", "the pipeline's graph, serialized to tell whether "
             "every pass yields the same batches (without it: told as not exact)", f"{_D}: tf_dataset_kind",
             has("tensorflow:data.Dataset", "_variant_tensor"), token="_variant_tensor", package=_TF, required=False),
    Internal("tensorflow.python.framework.ops.EagerTensor._numpy", "a view of a variable's buffer "
             "(without it: a copy, slower)", f"{_S}: variable_array",
             has("tensorflow.python.framework.ops:EagerTensor", "_numpy"), token='"_numpy"', package=_TF,
             required=False),
    *(Internal(name, "compared by class name: what kind of input fit reads", f"{_D}: sample_batch",
               has(f"{_DATA}.{module}", name), token=f'"{name}"')
      for name, module in _ADAPTERS.items()),
    *(Internal(f"{cls.__name__}.{a}", "a stateful callback's state (saved, restored)",
               f"{_S}: callback_state", uses(cls, a), token="CALLBACK_STATE")
      for cls, attrs in CALLBACK_STATE.items() for a in attrs),
)


COMPAT = Framework("keras", [Package("keras", "keras", ">=3.13,<4"),
                             Package("tensorflow", "tensorflow", ">=2.16,<3", only_if_imported=True)], INTERNALS)
