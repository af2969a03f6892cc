"""``imdb_fasttext``: the Keras example's fastText classifier on IMDb with bigram features, Keras 3.

Bigram augmentation as in the original: every bigram of the training reviews gets its own token
index after the ``max_features`` (20,000) word indices, the bigram tokens found in each review are
appended to it, and the vocabulary grows accordingly (to about 1.2 M on the real data: a 60 M
parameter embedding). Then sequences are padded / truncated to 400 tokens; Embedding 50 -
GlobalAveragePooling1D - Dense 1 (sigmoid); Adam, binary cross-entropy, 5 epochs of batch 32,
validated on the test set after every epoch. The bigram -> index map is built from the sorted bigram
set (the original enumerated a Python ``set``: same features, a stable numbering).

Real data: ``keras.datasets.imdb.load_data(num_words=20000)`` (17 MB). Synthetic: Zipf-distributed
word indices with IMDb's numbering (1 = start, words from 4), class-dependent word frequencies,
varied lengths; a small vocabulary in the small sizes, so the bigram vocabulary stays small too.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from . import common

NAME = "imdb_fasttext"
FRAMEWORK = "keras"
MODEL = "Embedding 50 + bigrams -> GlobalAvgPool -> sigmoid (maxlen 400)"
OPTIMIZER = "Adam (lr 0.001)"
DATASET = "IMDb 25k/25k, 20k words+bigrams"
EPOCHS = 5
BATCH_SIZE = 32
MAX_FEATURES = 20000
MAXLEN = 400
EMBEDDING_DIMS = 50
NGRAM_RANGE = 2
# synthetic (train, test, vocabulary, mean review length) per size
SIZES = {"tiny": (128, 32, 200, 60), "small": (4000, 500, 2000, 230), "full": (25000, 25000, 20000, 230)}


def create_ngram_set(input_list: Sequence[int], ngram_value: int = 2) -> Set[Tuple[int, ...]]:
    """The set of n-grams of a list: ``create_ngram_set([1, 4, 9, 4], 2)`` = {(1, 4), (4, 9), (9, 4)}."""
    return set(zip(*[input_list[i:] for i in range(ngram_value)]))


def add_ngram(sequences: Sequence[Sequence[int]], token_indice: Dict[Tuple[int, ...], int],
              ngram_range: int = 2) -> List[List[int]]:
    """Append to each sequence the token of every n-gram (2..ngram_range) of it that has one."""
    new_sequences = []
    for input_list in sequences:
        new_list = list(input_list)
        for ngram_value in range(2, ngram_range + 1):
            for i in range(len(new_list) - ngram_value + 1):
                ngram = tuple(new_list[i:i + ngram_value])
                if ngram in token_indice:
                    new_list.append(token_indice[ngram])
        new_sequences.append(new_list)
    return new_sequences


def add_bigram_features(x_train, x_test, max_features: int, ngram_range: int = NGRAM_RANGE):
    """The original's n-gram augmentation: returns (x_train, x_test, grown max_features)."""
    ngram_set: Set[Tuple[int, ...]] = set()
    for input_list in x_train:
        for i in range(2, ngram_range + 1):
            ngram_set.update(create_ngram_set(input_list, ngram_value=i))
    start_index = max_features + 1
    token_indice = {v: k + start_index for k, v in enumerate(sorted(ngram_set))}
    max_features = (max(token_indice.values()) + 1) if token_indice else max_features
    return (add_ngram(x_train, token_indice, ngram_range), add_ngram(x_test, token_indice, ngram_range),
            int(max_features))


def load_data(synthetic: bool = False, size: Optional[str] = None) -> Dict[str, Any]:
    """Padded int32 sequences (N, 400) with bigram tokens, int labels; ``config`` carries the grown
    ``max_features`` for :func:`build_model`."""
    import keras
    import numpy as np

    size = common.resolve_size(synthetic, size)
    n_train, n_test, vocab, mean_len = common.pick(SIZES, size)
    if synthetic:
        x_train, y_train = common.synthetic_reviews(n_train, vocab, seed=5, mean_len=mean_len)
        x_test, y_test = common.synthetic_reviews(n_test, vocab, seed=6, mean_len=mean_len)
        max_features = vocab
        note = f"synthetic IMDb-like reviews ({n_train} / {n_test}, {vocab} words)"
    else:
        (x_train, y_train), (x_test, y_test) = keras.datasets.imdb.load_data(num_words=MAX_FEATURES)
        x_train, y_train = common.subset(None if size == "full" else n_train, x_train, y_train)
        x_test, y_test = common.subset(None if size == "full" else n_test, x_test, y_test)
        max_features = MAX_FEATURES
        note = "keras.datasets.imdb"
    x_train, x_test, max_features = add_bigram_features(x_train, x_test, max_features)
    pad = lambda x: keras.utils.pad_sequences(x, maxlen=MAXLEN).astype(np.int32)  # noqa: E731
    return {"x_train": pad(x_train), "y_train": np.asarray(y_train, dtype=np.float32),
            "x_test": pad(x_test), "y_test": np.asarray(y_test, dtype=np.float32),
            "config": {"max_features": max_features},
            "note": f"{note}; {max_features} features with bigrams"}


def build_model(max_features: int = MAX_FEATURES, maxlen: int = MAXLEN):
    """``max_features``: the vocabulary after the bigram augmentation (``load_data``'s config)."""
    import keras

    return keras.Sequential([
        keras.Input((maxlen,), dtype="int32"),
        keras.layers.Embedding(max_features, EMBEDDING_DIMS),
        keras.layers.GlobalAveragePooling1D(),
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
