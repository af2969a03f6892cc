"""``ResumableData``: a ``keras.utils.PyDataset`` whose order is a pure function of (seed, epoch).

Why it exists: Keras' own input pipelines cannot be positioned inside an epoch from outside, and
some of their shuffles draw from state nobody can save. This wrapper computes each epoch's order from
``(seed, epoch)`` (:class:`keepalive.dataorder.EpochOrder`) and can start an epoch at any batch
without reading the skipped samples, so with :class:`keepalive.callbacks.keras.DriveCheckpoint` a
run can be checkpointed every N steps / minutes and resumed in the middle of an epoch, bit for bit.

Two forms:

* arrays: ``ResumableData(x, y, sample_weight, batch_size=32, shuffle=True)``, where each of ``x``,
  ``y``, ``sample_weight`` is a NumPy array or a tuple / list / dict of arrays (multi-input models);
  samples are shuffled per epoch and cut into batches;
* a ``PyDataset`` of yours: ``ResumableData(my_py_dataset, shuffle=True)`` visits its batches in an
  order shuffled per epoch (batch-level, like Keras' ``shuffle=True`` for a PyDataset).

Batches are fetched in the input pipeline's thread (``workers`` of a wrapped PyDataset are not used:
parallel workers would make which call sees which state depend on timing).

Under ``DriveCheckpoint`` every pass of ``fit`` over the data is bound to its epoch when the pass
starts; on its own (no DriveCheckpoint) every pass uses the order of ``data.epoch`` (set it yourself
to change the order between ``fit`` calls).

Data order under ``DriveCheckpoint``: which inputs resume exactly. "Exact" means the resumed run's
final variables are bit-identical to an uninterrupted run's (tests/test_keras_crash.py,
tests/test_keras_position.py, on the TensorFlow and the JAX backend); with no kill, adding
DriveCheckpoint changes nothing (tests/test_keras_position.py::test_keepalive_is_transparent).

* :class:`ResumableData` around NumPy arrays or a ``keras.utils.PyDataset``: every epoch's order is a
  function of (seed, epoch), so any ``every=`` works and a resume starts in the middle of an epoch at
  the saved batch (no skipped batch is loaded). Use it for ``every=<steps>`` or ``every="10min"`` and
  for exact deadline stops.
* Plain NumPy arrays: checkpoints at epoch ends, exact.

  - TensorFlow backend: Keras draws the order inside a ``tf.data`` graph from TensorFlow's global seed
    (``keras.utils.set_random_seed``), fixed when ``fit`` builds its pipeline; exact when the re-run
    sets the same seed before ``fit`` (a differing seed is reported). Note that with a global seed
    Keras 3 draws *the same order in every epoch* this way (cf. tensorflow/tensorflow#29558);
    ``ResumableData`` reshuffles per epoch. Without a global seed TensorFlow's kernel draws each
    pass's order from a seed no library can read: a resumed run's epochs are shuffled anew (as no
    unseeded run reproduces either); told once, at the first save.
  - JAX backend: Keras shuffles with NumPy's global generator at a pass's first batch: restored.
  - torch backend: a torch ``RandomSampler`` drawing from torch's global generator: restored.
* ``fit(steps_per_epoch=k)`` over data of more than k batches (the Colab TPU tutorial's shape) keeps
  one iterator across epochs: a checkpoint stores how many batches of the running pass were consumed
  and the RNG states the pass drew its order from, and a resume continues that pass at that batch
  (:class:`PassPosition`). Batches are skipped by index without loading them for arrays on JAX and
  for PyDatasets; drawn from a fresh iterator for the TensorFlow backend's ``tf.data`` pipelines (an
  in-memory gather for arrays; the pipeline's work for a ``tf.data.Dataset``). Exact for arrays
  (TensorFlow: with a global seed), PyDatasets without workers (with ``shuffle=True`` on JAX only),
  and the ``tf.data`` pipelines below that repeat; otherwise told once, at the first save.
* ``tf.data.Dataset`` (classified from its serialized graph, :func:`tf_dataset_kind`): without
  shuffle and random ops, or with seeded shuffles that do not reshuffle, every pass is the same:
  exact, no warning. Seeded shuffles that reshuffle per iteration: exact when the fit keeps one
  iterator (``.repeat()`` with ``steps_per_epoch``), else told (the seed advances inside TensorFlow
  with every new pass). Unseeded shuffles, random ``map()``s (``tf.image.random_*``), ``from_generator``:
  told. (``tf.train.Checkpoint(iterator=...)`` could save such an iterator, shuffle buffer included;
  not used: its save costs at every checkpoint what a resume saves once, benchmarks/keras_data_position.py.)
* Python generators, PyDatasets with ``workers``, PyDatasets with ``shuffle=True`` (fit's default) on
  the TensorFlow / torch backend (the order is drawn when a pass starts, on the TensorFlow backend
  ahead of time in its own thread): epoch-end checkpoints, and the order after a resume is whatever
  the pipeline produces then; told once, at the first save. Wrap arrays / PyDatasets in
  :class:`ResumableData` for exactness anywhere. ``fit(steps_per_epoch=...)`` with ResumableData and
  PyDatasets with ``workers > 1`` also mean epoch-end checkpoints.
"""
from __future__ import annotations

import hashlib
import inspect
import random
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import keras
import numpy as np

from .. import rng
from ..dataorder import EpochOrder, mix
from . import _compat_keras as kc
from ._keras_state import tf_global_seed

__all__ = ["PassPosition", "ResumableData", "bind_passes", "batch_samples", "default_data_seed", "inexact_input",
           "pass_length", "resume_at", "sample_batch", "set_epoch_length", "skip_pass", "tf_dataset_kind",
           "unbind_passes", "unskip_pass"]


def default_data_seed() -> int:
    """A seed that follows the user's seeding without consuming any generator.

    Derived from NumPy's global generator state (``keras.utils.set_random_seed`` / ``np.random.seed``
    fix it), so two runs seeded alike shuffle alike; a resumed run takes the seed from the checkpoint.
    """
    _, keys, pos, *_ = np.random.get_state()
    digest = hashlib.blake2b(np.asarray(keys).tobytes(), digest_size=8).digest()
    return mix(int.from_bytes(digest, "little"), int(pos))


def _length(x: Any) -> int:
    if isinstance(x, dict):
        return _length(next(iter(x.values())))
    if isinstance(x, (list, tuple)):
        return _length(x[0])
    return int(x.shape[0]) if hasattr(x, "shape") else len(x)


def _take(x: Any, idx: np.ndarray) -> Any:
    if x is None:
        return None
    if isinstance(x, dict):
        return {k: _take(v, idx) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_take(v, idx) for v in x)
    if isinstance(x, np.ndarray):
        return np.take(x, idx, axis=0)
    return x[np.sort(idx)][np.argsort(np.argsort(idx))] if hasattr(x, "shape") else [x[i] for i in idx]


class ResumableData(keras.utils.PyDataset):
    """Batches of arrays (or of a PyDataset) in an order that depends only on (seed, epoch).

    Args:
        x: inputs: an array, a tuple / list / dict of arrays, or a ``keras.utils.PyDataset``.
        y, sample_weight: targets and weights (arrays or structures of arrays), for array inputs.
        batch_size: samples per batch (array inputs; default 32).
        shuffle: reshuffle every epoch (default True); False keeps the stored order.
        seed: the shuffle seed; default: derived from NumPy's global seed state (see
            :func:`default_data_seed`). A resumed run uses the seed saved in the checkpoint.
        drop_last: drop the last, incomplete batch of each epoch.
    """

    def __init__(self, x: Any, y: Any = None, sample_weight: Any = None, *, batch_size: int = 32,
                 shuffle: bool = True, seed: Optional[int] = None, drop_last: bool = False):
        super().__init__(workers=1, use_multiprocessing=False)
        self.source: Optional[keras.utils.PyDataset] = None
        if isinstance(x, keras.utils.PyDataset):
            if y is not None or sample_weight is not None:
                raise ValueError("a PyDataset yields its own targets: pass y / sample_weight in it")
            self.source = x
            n = x.num_batches
            if n is None:
                raise ValueError("an infinite PyDataset (num_batches None) has no epochs to shuffle")
            batch_size, drop_last = 1, False
        else:
            n = _length(x)
            for name, part in (("y", y), ("sample_weight", sample_weight)):
                if part is not None and _length(part) != n:
                    raise ValueError(f"x has {n} samples but {name} has {_length(part)}")
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.order = EpochOrder(n, batch_size, seed=default_data_seed() if seed is None else seed,
                                shuffle=shuffle, drop_last=drop_last)
        if self.order.batches_per_epoch == 0:
            raise ValueError(f"{n} samples make no batch of {batch_size}")
        #: the epoch and first batch of the pass Keras iterates (set by DriveCheckpoint per pass)
        self.epoch = 0
        self.start = 0
        self._next: Tuple[int, int] = (0, 0)

    # --------------------------------------------------------------------------------- order
    @property
    def seed(self) -> int:
        return self.order.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self.order.seed = int(value)
        self.order._cache = None

    @property
    def batch_size(self) -> Optional[int]:
        return None if self.source is not None else self.order.batch_size

    @property
    def batches_per_epoch(self) -> int:
        return self.order.batches_per_epoch

    def samples_in(self, b: int) -> int:
        """How many samples batch ``b`` holds (batches of a wrapped PyDataset count as 1)."""
        return 1 if self.source is not None else self.order.batch_len(b)

    def samples_between(self, first: int, n: int) -> int:
        """How many samples batches ``first`` .. ``first + n - 1`` of an epoch hold."""
        return sum(self.samples_in(b) for b in range(first, first + n) if b < self.batches_per_epoch)

    def get(self, epoch: int, b: int) -> Any:
        """Batch ``b`` of epoch ``epoch`` (reads only that batch's samples)."""
        idx = self.order.batch(epoch, b)
        if self.source is not None:
            return self.source[int(idx[0])]
        xb = _take(self.x, idx)
        if self.y is None and self.sample_weight is None:
            return (xb,)
        if self.sample_weight is None:
            return xb, _take(self.y, idx)
        return xb, _take(self.y, idx), _take(self.sample_weight, idx)

    # ----------------------------------------------------------------------- passes (fit)
    def plan(self, epoch: int, start: int = 0) -> None:
        """The next pass Keras starts over this data is epoch ``epoch`` from batch ``start``."""
        self._next = (int(epoch), int(start))
        self.epoch, self.start = self._next

    def next_pass(self) -> Tuple[int, int]:
        """Bind the pass that starts now: returns its (epoch, first batch); the one after is epoch+1."""
        epoch, start = self._next
        self._next = (epoch + 1, 0)
        self.epoch, self.start = epoch, start
        return epoch, start

    # ------------------------------------------------------------------------- PyDataset API
    def __len__(self) -> int:
        return self.order.batches_per_epoch - self.start

    def __getitem__(self, i: int) -> Any:
        if i < 0:
            i += len(self)
        return self.get(self.epoch, self.start + int(i))

    def on_epoch_begin(self) -> None:
        if self.source is not None:
            self.source.on_epoch_begin()

    def on_epoch_end(self) -> None:
        if self.source is not None:
            self.source.on_epoch_end()

    def __repr__(self) -> str:
        what = f"PyDataset {type(self.source).__name__}" if self.source is not None else \
            f"{self.order.n} samples"
        return (f"ResumableData({what}, batch_size={self.batch_size}, shuffle={self.order.shuffle}, "
                f"seed={self.seed}, {self.batches_per_epoch} batches/epoch)")


# ------------------------------------------------------------------------- fit's input pipeline
def bind_passes(iterator: Any) -> Tuple[Optional[ResumableData], Any, Optional[str]]:
    """With :class:`ResumableData` as ``fit``'s input, make every pass of fit's input pipeline (its
    ``epoch_iterator``) yield the batches of the epoch and from the batch the data planned.

    Returns ``(data, keras_adapter, problem)``: ``data`` None when the input is no ResumableData or
    this fit cannot be bound (then ``problem`` says why, for a warning: checkpoints at epoch ends).
    """
    adapter: Any = getattr(iterator, "data_adapter", None)
    ds = getattr(adapter, "py_dataset", None)
    if not isinstance(ds, ResumableData):
        return None, None, None
    if getattr(adapter, "enqueuer", None) is not None or not hasattr(adapter, kc.FINITE_GENERATOR) \
            or not hasattr(adapter, "_standardize_batch") or not hasattr(iterator, "_num_batches"):
        return None, None, ("this Keras version iterates ResumableData differently; checkpoints at "
                            "epoch ends only")
    if getattr(iterator, "steps_per_epoch", None):
        return None, None, ("fit(steps_per_epoch=...) with ResumableData: checkpoints at epoch ends "
                            "only; leave steps_per_epoch out to resume inside epochs")

    def one_pass():
        epoch, start = ds.next_pass()
        for b in range(start, ds.batches_per_epoch):
            yield adapter._standardize_batch(ds.get(epoch, b))

    setattr(adapter, kc.FINITE_GENERATOR, one_pass)  # per instance: fit's input pipeline calls it per pass
    return ds, adapter, None


def resume_at(data: Optional[ResumableData], saved: Mapping[str, Any], epoch: int,
              batch: int) -> Tuple[int, List[str]]:
    """Where a resumed epoch starts: the checkpoint's ``batch`` if the input can start there (bound
    ResumableData, which is given the saved seed and planned), else 0. Returns that batch and the
    problems the user must hear (a resume that will not be exact)."""
    if data is None:
        if not batch:
            return 0, []
        return 0, [f"the checkpoint is at batch {batch} of epoch {epoch}, but this fit's data cannot "
                   f"start inside an epoch (wrap it in ResumableData); epoch {epoch} restarts at its "
                   "first batch"]
    problems = []
    per_epoch = data.batches_per_epoch
    if saved.get("seed") is not None:
        data.seed = int(saved["seed"])
    if saved.get("batches_per_epoch") not in (None, per_epoch):
        problems.append(f"the data now has {per_epoch} batches per epoch, the checkpoint was made "
                        f"with {saved.get('batches_per_epoch')}")
    # batch == per_epoch: saved during the epoch's validation, after all its batches (an epoch with no
    # batch left: skip_pass); past the epoch, or at its end with another length: the data changed size
    if batch > per_epoch or (batch == per_epoch and saved.get("batches_per_epoch") != per_epoch):
        problems.append(f"the checkpoint is at batch {batch} of epoch {epoch}, but the data now has "
                        f"{per_epoch} batches per epoch; epoch {epoch} restarts at its first batch")
        batch = 0
    data.plan(epoch, batch)
    return batch, problems


def unbind_passes(adapter: Any) -> None:
    """Undo :func:`bind_passes` (the Keras data adapter iterates as Keras does again)."""
    adapter.__dict__.pop(kc.FINITE_GENERATOR, None)


def set_epoch_length(iterator: Any, callbacks: List[Any], batches: int) -> None:
    """A resumed epoch that starts at a later batch has fewer batches: fit's iterator and the
    progress bar (cosmetic) count those."""
    iterator._num_batches = batches
    for cb in callbacks:
        if isinstance(cb, keras.callbacks.ProgbarLogger) and getattr(cb, "target", None):
            cb.target = batches


def skip_pass(iterator: Any, data: ResumableData) -> None:
    """fit's next pass over the data yields no batch: the epoch resumed was saved during its
    validation, after all its batches, so it goes on to its validation and its end at once. The pass
    is bound (ResumableData's next pass is the next epoch's) and the data adapter told of the pass's
    start and end, as a pass over the remaining zero batches would. Undone by :func:`unskip_pass`."""
    adapter = getattr(iterator, "data_adapter", None)

    def no_batches() -> Any:
        data.next_pass()
        if adapter is not None:
            adapter.on_epoch_begin()
            adapter.on_epoch_end()
        return
        yield  # a generator, as the method it stands in for

    iterator._enumerate_iterator = no_batches  # per instance: fit iterates the pass through it


def unskip_pass(iterator: Any) -> None:
    """Undo :func:`skip_pass` (fit's passes yield their batches again)."""
    if iterator is not None:
        iterator.__dict__.pop("_enumerate_iterator", None)


def batch_samples(adapter: Any, first: int, n: int) -> int:
    """How many samples batches ``first`` .. ``first + n - 1`` of a Keras data adapter hold (an
    estimate for the ``samples`` counter; 0 when the adapter does not say)."""
    try:
        bs = adapter.batch_size
        if not bs:  # a PyDataset's adapter: asked before num_batches, which calls the user's __len__
            return 0
        nb = adapter.num_batches
        last = adapter.partial_batch_size if adapter.has_partial_batch else bs
        return sum(last if nb and b == nb - 1 else bs for b in range(first, first + n))
    except Exception:  # noqa: BLE001 - an estimate only
        return 0


def sample_batch(iterator: Any, data: Optional[ResumableData]) -> Any:
    """One batch of ``fit``'s input (or its symbolic shapes), found WITHOUT drawing from the input
    pipeline, to build an unbuilt model before the first step; None where no such batch can be had.

    Why: a model without known input shapes (no ``keras.Input``, a subclassed model) and the compiled
    metrics are built by Keras inside the first step on the TensorFlow backend; a checkpoint can only
    be loaded into variables that exist, before that step. Taking a batch from the pipeline would
    shift the data order (a generator, ResumableData's pass plan), so each input type is peeked at.
    """
    adapter: Any = getattr(iterator, "data_adapter", None)
    try:
        if data is not None:
            return data.get(data.epoch, data.start)
        name = type(adapter).__name__
        if name == "ArrayDataAdapter":
            return keras.tree.map_structure(lambda a: None if a is None else a[:1], adapter._inputs)
        if name == "TFDatasetAdapter":
            return keras.tree.map_structure(
                lambda spec: keras.KerasTensor(tuple(spec.shape), spec.dtype.name),
                adapter._dataset.element_spec)
        if name == "GeneratorDataAdapter" and getattr(adapter, "_first_batches", None):
            return adapter._first_batches[0]  # Keras peeked at it already (and puts it back)
        if name == "PyDatasetAdapter":
            return _peek(lambda: adapter.py_dataset[0])
    except Exception:  # noqa: BLE001 - an unknown layout: the caller says what that means
        return None
    return None


def _peek(fetch: Callable[[], Any]) -> Any:
    """What ``fetch`` returns, with every global random generator left as it was: a user's
    ``__getitem__`` may augment with them (NumPy's, Python's, a backend's), and a batch keepalive looks
    at must not change the training's draws."""
    with rng.unchanged():
        return fetch()


def inexact_input(iterator: Any, data: Optional[ResumableData]) -> Optional[str]:
    """Why this fit's input cannot resume exactly, even at epoch ends (said once, at the first save),
    or None."""
    if data is not None:
        return None
    adapter: Any = getattr(iterator, "data_adapter", None)
    name, backend = type(adapter).__name__, keras.backend.backend()
    what = None
    if name == "TFDatasetAdapter":
        kind = tf_dataset_kind(adapter._dataset)
        one_iterator = bool(getattr(iterator, "steps_per_epoch", None)) and adapter.num_batches is None
        if kind == "random" or (kind == "stream" and not one_iterator):
            what = ("a tf.data.Dataset whose order is drawn inside TensorFlow (an unseeded shuffle, a "
                    "shuffle reshuffled per epoch from a seed that advances with every pass, or random "
                    "map()s: their state cannot be saved)")
    elif name == "GeneratorDataAdapter":
        what = "a Python generator (its position cannot be saved or restored)"
    elif name == "PyDatasetAdapter" and (getattr(adapter, "enqueuer", None) is not None or (
            getattr(adapter, "shuffle", False) and backend != "jax")):
        what = ("a keras.utils.PyDataset with shuffle=True or workers (its order is drawn when a pass "
                "starts, ahead of the checkpoint)")
    elif name == "ArrayDataAdapter" and backend == "tensorflow" and getattr(adapter, "_shuffle", False) \
            and tf_global_seed() is None:
        return ("fit(shuffle=True) over NumPy arrays on the TensorFlow backend without a global seed: "
                "TensorFlow's kernel draws each epoch's order from a seed no library can read, so a "
                "resumed run's epochs are shuffled anew, not as the interrupted run would have (which no "
                "run without a seed reproduces either). For a bit-exact resume call "
                "keras.utils.set_random_seed(...) before fit, or wrap the arrays in "
                "keepalive.callbacks.keras.ResumableData(x, y, batch_size=...).")
    if what is None:
        return None
    return (f"this fit reads {what}: a resumed run restarts at the last epoch end and its data order "
            "will differ from an uninterrupted run's, so the resume is not bit-exact. For an exact "
            "resume (also inside an epoch), pass NumPy arrays or a PyDataset wrapped in "
            "keepalive.callbacks.keras.ResumableData(x, y, batch_size=...).")


def pass_length(iterator: Any) -> Optional[int]:
    """The number of batches of the running pass over the data, when Keras knows it."""
    n = getattr(iterator, "steps_per_epoch", None) or getattr(iterator, "_num_batches", None)
    return int(n) if n else None


# ------------------------------------------------------- a pass kept across epochs (steps_per_epoch)
def _host_rngs() -> Dict[str, Any]:
    """The host RNGs a pass's order is drawn from (arrays: NumPy; a PyDataset: Python's ``random``;
    the torch backend's DataLoader: torch's generator)."""
    state: Dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch = sys.modules.get("torch")
    if torch is not None and keras.backend.backend() == "torch":
        state["torch_cpu"] = torch.get_rng_state()
    return state


def tf_dataset_kind(dataset: Any) -> str:
    """What a fresh iterator over a ``tf.data.Dataset`` yields, read from its serialized graph:

    * ``"fixed"``: the same elements every time (no shuffle, or shuffles with a seed and
      ``reshuffle_each_iteration=False``; no random op, no Python function);
    * ``"stream"``: seeded shuffles that reshuffle per iteration: a new dataset's first iterator yields
      the same stream, later iterators of it other ones (their seeds advance inside TensorFlow);
    * ``"random"``: an unseeded shuffle (its kernel draws seeds nobody can read), a stateful random
      op in a ``map`` (``tf.image.random_*``), a Python generator / ``py_function``, or a graph that
      cannot be read."""
    import tensorflow as tf

    try:  # external_state_policy FAIL: a random op or a Python function inside refuses to serialize
        blob = tf.raw_ops.DatasetToGraphV2(input_dataset=dataset._variant_tensor, external_state_policy=2,
                                           strip_device_assignment=True)
        graph = tf.compat.v1.GraphDef()
        graph.ParseFromString(blob.numpy())
    except Exception:  # noqa: BLE001 - unreadable = not known to repeat
        return "random"
    nodes = {n.name: n for n in graph.node}
    kind = "fixed"
    for node in graph.node:
        if "Shuffle" not in node.op:
            continue
        seeds = []
        for name in node.input[2:4]:
            src = nodes.get(name.split(":")[0])
            if src is None or src.op != "Const":
                return "random"
            seeds.append(int(tf.make_ndarray(src.attr["value"].tensor)))
        if not any(seeds):
            return "random"
        if "reshuffle_each_iteration" not in node.attr or node.attr["reshuffle_each_iteration"].b:
            kind = "stream"
    return kind


class PassPosition:
    """Where fit stands in its pass over the data when that pass outlives an epoch.

    ``fit(steps_per_epoch=k)`` over data of n > k batches (arrays, a PyDataset, a finite or repeated
    ``tf.data.Dataset``) keeps ONE iterator across epochs: epoch 2 continues where epoch 1 stopped and a
    new pass starts only when the data runs out. A resumed run must continue that pass at the same
    batch, not start a new one. This follows the pass: how many of its batches fit consumed
    (``EpochIterator._steps_seen``), and the host RNG states when the pass drew its order (recorded
    lazily at its first batch on the JAX / torch backends, where arrays are shuffled with NumPy's
    global generator and a PyDataset's batch order with Python's ``random``). A resume recreates the
    pass from those states and skips the consumed batches: by index, without loading them, for arrays
    on JAX and for PyDatasets; by drawing them for the tf.data pipelines of the TensorFlow backend
    (an in-memory gather for arrays; the dataset's own work for a ``tf.data.Dataset``).

    ``problem`` (None when exact) says why a resume cannot continue the pass: an unseeded TensorFlow
    shuffle, a ``tf.data`` pipeline with random ops, a generator, PyDataset workers.
    """

    def __init__(self, iterator: Any, data: Optional[ResumableData]) -> None:
        self.it = iterator
        self.adapter: Any = getattr(iterator, "data_adapter", None)
        steps: Any = getattr(iterator, "steps_per_epoch", None)
        n: Any = getattr(self.adapter, "num_batches", None)
        #: the iterator outlives an epoch: fit(steps_per_epoch=...) over data of more batches (or endless)
        self.active = bool(steps) and data is None and (n is None or int(n) > int(steps))
        self.pass_rng: Optional[Dict[str, Any]] = None
        self._orig: Any = None
        self.problem = self._why_not() if self.active else None
        if self.active and self.problem is None and keras.backend.backend() != "tensorflow":
            # the JAX / torch backends draw a pass's order on the host: note the RNGs when it does
            self._orig = iterator._get_iterator
            iterator._get_iterator = self._recording

    def _why_not(self) -> Optional[str]:
        name, backend = type(self.adapter).__name__, keras.backend.backend()
        what = None
        if name == "ArrayDataAdapter":
            if backend == "tensorflow" and getattr(self.adapter, "_shuffle", False) and \
                    tf_global_seed() is None:
                what = "NumPy arrays shuffled by TensorFlow without a global seed"
        elif name == "PyDatasetAdapter":
            if getattr(self.adapter, "enqueuer", None) is not None:
                what = "a PyDataset with workers"
            elif getattr(self.adapter, "shuffle", False) and backend == "tensorflow":
                what = "a PyDataset with shuffle=True on the TensorFlow backend"
        elif name == "TFDatasetAdapter":
            kind = tf_dataset_kind(self.adapter._dataset)
            if kind == "random" or (kind == "stream" and self.adapter.num_batches is not None):
                what = "a tf.data.Dataset with an unseeded shuffle or random map()s"
        else:
            what = "a Python generator"
        if what is None:
            return None
        return (f"fit(steps_per_epoch=...) over {what} keeps one pass over the data across epochs; "
                "keepalive cannot recreate that pass, so after a resume it starts a new pass at its "
                "first batch and the resumed epochs see other batches than an uninterrupted run. For an "
                "exact resume leave steps_per_epoch out, or seed the order (keras.utils.set_random_seed, "
                "shuffle(seed=...)), or pass arrays / a PyDataset in "
                "keepalive.callbacks.keras.ResumableData(x, y, batch_size=...).")

    # ------------------------------------------------------------------------ recording (capture)
    def _recording(self, record: bool = True) -> Any:
        src = self._orig()
        if not record:
            return src
        if inspect.isgenerator(src):  # JAX: the order is drawn at the pass's first batch
            def first_batch_notes() -> Any:
                self.pass_rng = _host_rngs()
                yield from src
            return first_batch_notes()
        self.pass_rng = _host_rngs()  # a torch DataLoader draws when it is iterated: now
        return src

    def state(self) -> Optional[Dict[str, Any]]:
        """For the checkpoint (taken at an epoch end): batches consumed of the running pass, and the
        RNG states its order came from."""
        if not self.active or self.problem is not None:
            return None
        return {"position": int(getattr(self.it, "_steps_seen", 0) or 0), "rng": self.pass_rng}

    # ---------------------------------------------------------------------------------- resume
    def restore(self, saved: Optional[Mapping[str, Any]]) -> Optional[str]:
        """Continue the saved pass at its batch (at the start of the resumed fit, before its first
        epoch); the problem in words where that cannot be done, else None."""
        p = int((saved or {}).get("position") or 0)
        if not self.active or self.problem is not None or not p:
            return None
        n = self.adapter.num_batches
        if n is not None and p >= int(n):
            return (f"the checkpoint is {p} batches into a pass over the data, which now has {n} "
                    "batches: the resumed fit starts a new pass")
        live = _host_rngs()
        pass_rng = (saved or {}).get("rng")
        try:
            if pass_rng:
                rng.restore(pass_rng)
            skipped = self._skip_by_index(p)
            src = self._recording(record=False) if self._orig is not None else self.it._get_iterator()
            it = iter(src)
            for _ in range(p - skipped):
                next(it)
        finally:
            rng.restore(live)
        self.pass_rng = pass_rng
        self.it._current_iterator = it
        self.it._steps_seen = p
        return None

    def _skip_by_index(self, p: int) -> int:
        """Make the next pass the adapter creates start at batch ``p`` without loading the batches
        before it, where the adapter allows (arrays on JAX, a PyDataset without workers); how many
        batches that skips (0: the caller draws them)."""
        name, adapter = type(self.adapter).__name__, self.adapter
        if name == "PyDatasetAdapter" and hasattr(adapter, kc.FINITE_GENERATOR):
            order = list(range(adapter.py_dataset.num_batches))
            if adapter.shuffle:
                random.shuffle(order)  # what Keras' own pass draws, from the restored state

            def rest_of_pass() -> Any:
                adapter.__dict__.pop(kc.FINITE_GENERATOR, None)  # one pass only
                for i in order[p:]:
                    yield adapter._standardize_batch(adapter.py_dataset[i])

            setattr(adapter, kc.FINITE_GENERATOR, rest_of_pass)
            return p
        if name == "ArrayDataAdapter" and keras.backend.backend() == "jax" and hasattr(adapter, kc.ARRAY_PASS):
            make = getattr(type(adapter), kc.ARRAY_PASS)

            def skipping(slice_fn: Any, inputs: Any) -> Any:
                adapter.__dict__.pop(kc.ARRAY_PASS, None)  # one pass only
                loading = [False]
                gen = make(adapter, lambda sliceable, indices=None: slice_fn(sliceable, indices)
                           if loading[0] else None, inputs)
                for _ in range(p):  # the permutation is drawn at the first; nothing is sliced
                    next(gen)
                loading[0] = True
                return gen

            setattr(adapter, kc.ARRAY_PASS, skipping)
            return p
        return 0

    def unbind(self) -> None:
        if self._orig is not None:
            self.it.__dict__.pop("_get_iterator", None)
            self._orig = None

