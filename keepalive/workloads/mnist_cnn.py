"""``mnist_cnn``: the Keras example's convnet on MNIST, ported to Keras 3.

Conv 32 3x3 (ReLU) - Conv 64 3x3 (ReLU) - MaxPool 2x2 - Dropout 0.25 - Flatten - Dense 128 (ReLU) -
Dropout 0.5 - Dense 10 (softmax); Adadelta with the original's learning rate 1.0 (Keras 2's default;
Keras 3 defaults to 0.001, which would barely train in 12 epochs), categorical cross-entropy,
12 epochs of batch 128, validated on the test set after every epoch.

Real data: ``keras.datasets.mnist.load_data()``. Synthetic: uint8 28x28 images of 10 learnable
classes, same shapes and dtypes.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Optional

from . import common

NAME = "mnist_cnn"
FRAMEWORK = "keras"
MODEL = "Conv32-Conv64-MaxPool-Dropout-Dense128"
OPTIMIZER = "Adadelta (lr 1.0, rho 0.95)"
DATASET = "MNIST 60k/10k, 28x28"
EPOCHS = 12
BATCH_SIZE = 128
NUM_CLASSES = 10
SIZES = {"tiny": (256, 64), "small": (8192, 1000), "full": (60000, 10000)}


def load_data(synthetic: bool = False, size: Optional[str] = None) -> Dict[str, Any]:
    """``x_train`` (N, 28, 28, 1) float32 in [0, 1], ``y_train`` (N, 10) one-hot float32, test set."""
    import numpy as np

    from ._keras import mnist_style, one_hot

    size = common.resolve_size(synthetic, size)
    n_train, n_test = common.pick(SIZES, size)
    x_train, y_train, x_test, y_test, note = mnist_style("mnist", n_train, n_test, size, synthetic)
    prep = lambda x: (x.reshape(len(x), 28, 28, 1).astype(np.float32) / 255.0)  # noqa: E731
    return {"x_train": prep(x_train), "y_train": one_hot(y_train, NUM_CLASSES),
            "x_test": prep(x_test), "y_test": one_hot(y_test, NUM_CLASSES), "note": note}


def build_model():
    import keras

    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        keras.layers.Conv2D(64, (3, 3), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Dropout(0.25),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(NUM_CLASSES, activation="softmax"),
    ], name=NAME)


def compile_args() -> Dict[str, Any]:
    import keras

    return {"loss": "categorical_crossentropy",
            "optimizer": keras.optimizers.Adadelta(learning_rate=1.0, rho=0.95, epsilon=1e-7),
            "metrics": ["accuracy"]}


def run(dir: str, epochs: Optional[int] = None, synthetic: bool = False, size: Optional[str] = None,
        **kwargs: Any) -> Dict[str, Any]:
    """Train with checkpoints in ``dir`` (re-run to resume); per-epoch timings in ``dir/results.*``
    (keyword arguments: see :func:`keepalive.workloads._keras.run_keras`)."""
    from ._keras import run_keras

    return run_keras(sys.modules[__name__], dir, epochs=epochs, synthetic=synthetic, size=size, **kwargs)
