"""``cifar10_cnn``: the Keras example's small convnet on CIFAR-10 with data augmentation, in Keras 3.

2 x (Conv 3x3 - ReLU - Conv 3x3 - ReLU - MaxPool 2x2 - Dropout 0.25) with 32 then 64 filters,
Flatten - Dense 512 (ReLU) - Dropout 0.5 - Dense 10 (softmax); RMSprop(1e-4) with the original's
``decay=1e-6`` (Keras 3 has no ``decay`` argument: an ``InverseTimeDecay`` schedule computes the same
``lr / (1 + 1e-6 * iterations)``), categorical cross-entropy, 20 epochs of batch 32, validated on the
test set after every epoch.

Augmentation: the original's ``ImageDataGenerator(width_shift_range=0.1, height_shift_range=0.1,
horizontal_flip=True)`` (fill mode "nearest") is done by Keras 3's preprocessing layers at the front
of the model (``RandomTranslation(0.1, 0.1, fill_mode="nearest")``, ``RandomFlip("horizontal")``;
active in training only). ``ImageDataGenerator`` is legacy in Keras 3, and the layers draw from
seed-generator states that the checkpoint saves, so a resumed run augments exactly as an
uninterrupted one. They run inside the model (on the GPU where there is one), not in a CPU data
pipeline as the original: epoch times on a GPU are lower than with ``ImageDataGenerator``.

Real data: ``keras.datasets.cifar10.load_data()`` (170 MB). Synthetic: uint8 32x32x3 images of 10
learnable classes, labels shaped (N, 1) as the real ones.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Optional

from . import common

NAME = "cifar10_cnn"
FRAMEWORK = "keras"
MODEL = "2x(Conv-Conv-Pool-Dropout) 32/64, Dense512; shift/flip augmentation"
OPTIMIZER = "RMSprop (lr 1e-4, decay 1e-6)"
DATASET = "CIFAR-10 50k/10k, 32x32x3"
EPOCHS = 20
BATCH_SIZE = 32
NUM_CLASSES = 10
SIZES = {"tiny": (128, 32), "small": (4000, 500), "full": (50000, 10000)}


def load_data(synthetic: bool = False, size: Optional[str] = None) -> Dict[str, Any]:
    """``x_train`` (N, 32, 32, 3) float32 in [0, 1], ``y_train`` (N, 10) one-hot float32, test set."""
    import numpy as np

    from ._keras import one_hot

    size = common.resolve_size(synthetic, size)
    n_train, n_test = common.pick(SIZES, size)
    if synthetic:
        x_train, y_train = common.synthetic_images(n_train, (32, 32, 3), NUM_CLASSES, seed=3)
        x_test, y_test = common.synthetic_images(n_test, (32, 32, 3), NUM_CLASSES, seed=4)
        y_train, y_test = y_train.reshape(-1, 1), y_test.reshape(-1, 1)
        note = f"synthetic CIFAR-10-shaped data ({n_train} / {n_test})"
    else:
        import keras

        (x_train, y_train), (x_test, y_test) = keras.datasets.cifar10.load_data()
        x_train, y_train = common.subset(None if size == "full" else n_train, x_train, y_train)
        x_test, y_test = common.subset(None if size == "full" else n_test, x_test, y_test)
        note = "keras.datasets.cifar10"
    prep = lambda x: x.astype(np.float32) / 255.0  # noqa: E731
    return {"x_train": prep(x_train), "y_train": one_hot(y_train, NUM_CLASSES),
            "x_test": prep(x_test), "y_test": one_hot(y_test, NUM_CLASSES), "note": note}


def build_model():
    import keras
    from keras import layers

    return keras.Sequential([
        keras.Input((32, 32, 3)),
        layers.RandomTranslation(0.1, 0.1, fill_mode="nearest"),
        layers.RandomFlip("horizontal"),
        layers.Conv2D(32, (3, 3), padding="same"), layers.Activation("relu"),
        layers.Conv2D(32, (3, 3)), layers.Activation("relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Dropout(0.25),
        layers.Conv2D(64, (3, 3), padding="same"), layers.Activation("relu"),
        layers.Conv2D(64, (3, 3)), layers.Activation("relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Dropout(0.25),
        layers.Flatten(),
        layers.Dense(512), layers.Activation("relu"),
        layers.Dropout(0.5),
        layers.Dense(NUM_CLASSES), layers.Activation("softmax"),
    ], name=NAME)


def compile_args() -> Dict[str, Any]:
    import keras

    lr = keras.optimizers.schedules.InverseTimeDecay(1e-4, decay_steps=1, decay_rate=1e-6)
    return {"loss": "categorical_crossentropy", "optimizer": keras.optimizers.RMSprop(learning_rate=lr),
            "metrics": ["accuracy"]}


def run(dir: str, epochs: Optional[int] = None, synthetic: bool = False, size: Optional[str] = None,
        **kwargs: Any) -> Dict[str, Any]:
    """Train with checkpoints in ``dir`` (re-run to resume); per-epoch timings in ``dir/results.*``
    (keyword arguments: see :func:`keepalive.workloads._keras.run_keras`)."""
    from ._keras import run_keras

    return run_keras(sys.modules[__name__], dir, epochs=epochs, synthetic=synthetic, size=size, **kwargs)
