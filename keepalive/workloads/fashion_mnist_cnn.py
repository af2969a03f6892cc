"""``fashion_mnist_cnn``: the Colab "Fashion MNIST with Keras and TPUs" CNN, ported to Keras 3.

3 x (BatchNormalization - Conv 5x5 'same' ELU - MaxPool 2x2 - Dropout 0.25) with 64 / 128 / 256
filters, Flatten - Dense 256 ELU - Dropout 0.5 - Dense 10 softmax; Adam(1e-3), sparse categorical
cross-entropy, 5 epochs of 100 steps of batch 1024, validated on the test set after every epoch. The
inputs are the raw 0-255 pixel values as float32 (the first BatchNormalization normalises them), as
in the notebook.

Steps per epoch: the notebook drew 100 batches of 1024 per "epoch" (more than the 60,000 training
images) from a random-offset generator through ``steps_per_epoch``. Here every epoch is 100 batches
of 1024 samples drawn without replacement from the training set repeated (:class:`Repeated`), in
an order that is a function of (seed, epoch): same amount of work per epoch, and a resumed run sees
exactly the batches of an uninterrupted one.

Real data: ``keras.datasets.fashion_mnist.load_data()`` (30 MB). Synthetic: uint8 28x28 images of 10
learnable classes, same shapes and dtypes. The small sizes also shrink the batch and the steps per
epoch (a batch of 1024 through this network takes seconds on a CPU).
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Optional

from . import common

NAME = "fashion_mnist_cnn"
FRAMEWORK = "keras"
MODEL = "3x(BN-Conv 64/128/256 5x5 ELU-MaxPool-Dropout .25)-Dense 256 ELU-Dropout .5-softmax"
OPTIMIZER = "Adam (lr 0.001)"
DATASET = "Fashion-MNIST 60k/10k, 28x28"
EPOCHS = 5
BATCH_SIZE = 1024
STEPS_PER_EPOCH = 100
NUM_CLASSES = 10
# (train samples, test samples, batch size, steps per epoch) per size
SIZES = {"tiny": (256, 64, 32, 4), "small": (3000, 500, 128, 24), "full": (60000, 10000, 1024, 100)}


class Repeated:
    """``base`` repeated to ``length`` samples (index ``i`` is sample ``i % len(base)``), as float32 or
    another dtype; indexable by an index array without materialising the repetition."""

    def __init__(self, base, length: int, dtype: str = "float32"):
        self.base, self.length, self.dtype = base, int(length), dtype
        self.shape = (self.length,) + tuple(base.shape[1:])

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx):
        import numpy as np

        idx = np.asarray(idx)
        if idx.dtype == bool or np.any(idx >= self.length) or np.any(idx < 0):
            raise IndexError("Repeated takes non-negative integer indices below its length")
        return self.base[idx % len(self.base)].astype(self.dtype)


def load_data(synthetic: bool = False, size: Optional[str] = None) -> Dict[str, Any]:
    """``x_train``: a :class:`Repeated` view of (N, 28, 28, 1) float32 pixels 0-255 with exactly
    batch x steps samples per epoch; ``y_train`` int32 labels; the test set as arrays."""
    import numpy as np

    size = common.resolve_size(synthetic, size)
    n_train, n_test, batch, steps = common.pick(SIZES, size)
    from ._keras import mnist_style

    x_train, y_train, x_test, y_test, note = mnist_style("fashion_mnist", n_train, n_test, size,
                                                         synthetic, seeds=(10, 11))
    x_train, x_test = np.expand_dims(x_train, -1), np.expand_dims(x_test, -1)
    per_epoch = batch * steps
    return {"x_train": Repeated(x_train, per_epoch), "y_train": Repeated(y_train, per_epoch, "int32"),
            "x_test": x_test.astype(np.float32), "y_test": y_test.astype(np.int32),
            "config": {"batch_size": batch}, "train_samples": len(x_train),
            "note": f"{note}; {steps} steps of {batch} per epoch"}


def build_model():
    import keras
    from keras import layers

    model = keras.Sequential([keras.Input((28, 28, 1))], name=NAME)
    for filters in (64, 128, 256):
        model.add(layers.BatchNormalization())
        model.add(layers.Conv2D(filters, (5, 5), padding="same", activation="elu"))
        model.add(layers.MaxPooling2D(pool_size=(2, 2), strides=(2, 2)))
        model.add(layers.Dropout(0.25))
    model.add(layers.Flatten())
    model.add(layers.Dense(256))
    model.add(layers.Activation("elu"))
    model.add(layers.Dropout(0.5))
    model.add(layers.Dense(NUM_CLASSES))
    model.add(layers.Activation("softmax"))
    return model


def compile_args() -> Dict[str, Any]:
    import keras

    return {"loss": "sparse_categorical_crossentropy", "optimizer": keras.optimizers.Adam(learning_rate=1e-3),
            "metrics": ["sparse_categorical_accuracy"]}


def run(dir: str, epochs: Optional[int] = None, synthetic: bool = False, size: Optional[str] = None,
        **kwargs: Any) -> Dict[str, Any]:
    """Train with checkpoints in ``dir`` (re-run to resume); per-epoch timings in ``dir/results.*``
    (keyword arguments: see :func:`keepalive.workloads._keras.run_keras`)."""
    from ._keras import run_keras

    return run_keras(sys.modules[__name__], dir, epochs=epochs, synthetic=synthetic, size=size, **kwargs)
