"""``mnist_mlp``: the Keras example's multilayer perceptron on MNIST, ported to Keras 3.

Dense 512 (ReLU) - Dropout 0.2 - Dense 512 (ReLU) - Dropout 0.2 - Dense 10 (softmax), RMSprop
(Keras' defaults), categorical cross-entropy on one-hot labels, 20 epochs of batch 128, validated on
the test set after every epoch (as the original).

Real data: ``keras.datasets.mnist.load_data()`` (downloads 11 MB once). Synthetic: uint8 28x28
images of 10 learnable classes, same shapes and dtypes.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Optional

from . import common

NAME = "mnist_mlp"
FRAMEWORK = "keras"
MODEL = "MLP Dense 512-512, dropout 0.2"
OPTIMIZER = "RMSprop (lr 0.001)"
DATASET = "MNIST 60k/10k, 28x28"
EPOCHS = 20
BATCH_SIZE = 128
NUM_CLASSES = 10
# synthetic (train, test) samples per size; with real data a smaller size takes the first samples
SIZES = {"tiny": (512, 64), "small": (30000, 2000), "full": (60000, 10000)}


def load_data(synthetic: bool = False, size: Optional[str] = None) -> Dict[str, Any]:
    """``x_train`` (N, 784) float32 in [0, 1], ``y_train`` (N, 10) one-hot float32, and the test set."""
    import numpy as np

    from ._keras import mnist_style, one_hot

    size = common.resolve_size(synthetic, size)
    n_train, n_test = common.pick(SIZES, size)
    x_train, y_train, x_test, y_test, note = mnist_style("mnist", n_train, n_test, size, synthetic)
    prep = lambda x: (x.reshape(len(x), 784).astype(np.float32) / 255.0)  # noqa: E731
    return {"x_train": prep(x_train), "y_train": one_hot(y_train, NUM_CLASSES),
            "x_test": prep(x_test), "y_test": one_hot(y_test, NUM_CLASSES), "note": note}


def build_model():
    import keras

    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(NUM_CLASSES, activation="softmax"),
    ], name=NAME)


def compile_args() -> Dict[str, Any]:
    import keras

    return {"loss": "categorical_crossentropy", "optimizer": keras.optimizers.RMSprop(),
            "metrics": ["accuracy"]}


def run(dir: str, epochs: Optional[int] = None, synthetic: bool = False, size: Optional[str] = None,
        **kwargs: Any) -> Dict[str, Any]:
    """Train with checkpoints in ``dir`` (re-run to resume); per-epoch timings in ``dir/results.*``.

    Keyword arguments: ``every`` (checkpoint schedule, default ``"epoch"``), ``checkpoint`` (False:
    timings only), ``keep``, ``seed``, ``deterministic``, ``threads``, ``on_step``, ``on_commit``,
    ``verbose``, ``quiet`` (see :func:`keepalive.workloads.run`)."""
    from ._keras import run_keras

    return run_keras(sys.modules[__name__], dir, epochs=epochs, synthetic=synthetic,
                     size=size, **kwargs)
