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
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional, Tuple

import numpy as np
import keras

from ..dataorder import EpochOrder, mix

__all__ = ["ResumableData", "default_data_seed"]


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
