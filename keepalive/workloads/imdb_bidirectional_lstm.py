"""``imdb_bidirectional_lstm``: the Keras example's bidirectional LSTM on IMDb, ported to Keras 3.

Reviews of the 20,000 most frequent words, padded / truncated to 100 tokens; Embedding 128 -
Bidirectional(LSTM 64) - Dropout 0.5 - Dense 1 (sigmoid); Adam, binary cross-entropy, 4 epochs of
batch 32, validated on the test set after every epoch.

Real data: ``keras.datasets.imdb.load_data(num_words=20000)``. Synthetic: IMDb-like word indices
(see :func:`keepalive.workloads.common.synthetic_reviews`), same shapes and dtypes, a smaller
vocabulary in the small sizes.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Optional

from . import common

NAME = "imdb_bidirectional_lstm"
FRAMEWORK = "keras"
MODEL = "Embedding 128 -> BiLSTM 64 -> Dropout 0.5 -> sigmoid (maxlen 100)"
OPTIMIZER = "Adam (lr 0.001)"
DATASET = "IMDb 25k/25k, 20k words"
EPOCHS = 4
BATCH_SIZE = 32
MAX_FEATURES = 20000
MAXLEN = 100
SIZES = {"tiny": (128, 32, 500), "small": (3200, 500, 5000), "full": (25000, 25000, 20000)}


def load_data(synthetic: bool = False, size: Optional[str] = None) -> Dict[str, Any]:
    """Padded int32 sequences (N, 100), float32 0/1 labels; ``config`` carries ``max_features``."""
    import keras
    import numpy as np

    size = common.resolve_size(synthetic, size)
    n_train, n_test, vocab = common.pick(SIZES, size)
    if synthetic:
        x_train, y_train = common.synthetic_reviews(n_train, vocab, seed=7)
        x_test, y_test = common.synthetic_reviews(n_test, vocab, seed=8)
        max_features = vocab
        note = f"synthetic IMDb-like reviews ({n_train} / {n_test}, {vocab} words)"
    else:
        (x_train, y_train), (x_test, y_test) = keras.datasets.imdb.load_data(num_words=MAX_FEATURES)
        x_train, y_train = common.subset(None if size == "full" else n_train, x_train, y_train)
        x_test, y_test = common.subset(None if size == "full" else n_test, x_test, y_test)
        max_features = MAX_FEATURES
        note = "keras.datasets.imdb"
    pad = lambda x: keras.utils.pad_sequences(x, maxlen=MAXLEN).astype(np.int32)  # noqa: E731
    return {"x_train": pad(x_train), "y_train": np.asarray(y_train, dtype=np.float32),
            "x_test": pad(x_test), "y_test": np.asarray(y_test, dtype=np.float32),
            "config": {"max_features": max_features}, "note": note}


def build_model(max_features: int = MAX_FEATURES, maxlen: int = MAXLEN):
    import keras

    return keras.Sequential([
        keras.Input((maxlen,), dtype="int32"),
        keras.layers.Embedding(max_features, 128),
        keras.layers.Bidirectional(keras.layers.LSTM(64)),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(1, activation="sigmoid"),
    ], name=NAME)


def compile_args() -> Dict[str, Any]:
    import keras

    return {"loss": "binary_crossentropy", "optimizer": keras.optimizers.Adam(), "metrics": ["accuracy"]}


def run(dir: str, epochs: Optional[int] = None, synthetic: bool = False, size: Optional[str] = None,
        **kwargs: Any) -> Dict[str, Any]:
    """Train with checkpoints in ``dir`` (re-run to resume); per-epoch timings in ``dir/results.*``
    (keyword arguments: see :func:`keepalive.workloads._keras.run_keras`)."""
    from ._keras import run_keras

    return run_keras(sys.modules[__name__], dir, epochs=epochs, synthetic=synthetic, size=size, **kwargs)
