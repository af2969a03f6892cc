"""``lstm_text_generation``: the Keras example's character-level LSTM on Nietzsche, ported to Keras 3.

The text is lower-cased; every 3rd position starts a 40-character sentence whose next character is
the target; sentences and targets are one-hot boolean tensors (N, 40, 57) and (N, 57), as in the
original (at full size the inputs alone take ~457 MB). LSTM 128 - Dense 57 (softmax); RMSprop(0.01),
categorical cross-entropy, 10 epochs of batch 128 (the benchmark's figure; the example ran 60).

The original printed generated text after every epoch (1,600 single-step predictions, which would
dominate a benchmark's epoch time): here :func:`generate` does it once after training on real data
(``sample`` is the original's temperature sampling).

Real data: ``keras.utils.get_file('nietzsche.txt', ...)`` (600 kB). Synthetic: text from a random
sparse Markov chain over an alphabet of the same 57 characters as the lower-cased Nietzsche text.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

from .. import report
from . import common

NAME = "lstm_text_generation"
FRAMEWORK = "keras"
MODEL = "LSTM 128 on one-hot chars (maxlen 40, step 3) -> softmax"
OPTIMIZER = "RMSprop (lr 0.01)"
DATASET = "Nietzsche, 600k chars"
EPOCHS = 10
BATCH_SIZE = 128
MAXLEN = 40
STEP = 3
URL = "https://s3.amazonaws.com/text-datasets/nietzsche.txt"
#: the 57 symbols of the lower-cased Nietzsche text
ALPHABET = "\n !\"'(),-.0123456789:;=?[]_abcdefghijklmnopqrstuvwxyz\u00e4\u00e6\u00e9\u00eb"
# synthetic text length (characters) per size
SIZES = {"tiny": 3200, "small": 60000, "full": 600893}


def synthetic_text(n_chars: int, seed: int = 9) -> str:
    """Text from a sparse random Markov chain over :data:`ALPHABET` (learnable, all symbols used)."""
    import numpy as np

    rs = np.random.RandomState(seed)
    k = len(ALPHABET)
    trans = rs.dirichlet(np.full(k, 0.05), size=k)
    trans = 0.97 * trans + 0.03 / k
    out = np.empty(n_chars, dtype=np.int64)
    state = 0
    u = rs.uniform(size=n_chars)
    cdf = np.cumsum(trans, axis=1)
    for i in range(n_chars):
        state = min(int(np.searchsorted(cdf[state], u[i])), k - 1)
        out[i] = state
    return "".join(ALPHABET[i] for i in out)


def vectorize(text: str, chars: List[str], maxlen: int = MAXLEN, step: int = STEP):
    """The original's one-hot sentences: x (N, maxlen, len(chars)) bool, y (N, len(chars)) bool."""
    import numpy as np

    char_indices = {c: i for i, c in enumerate(chars)}
    starts = range(0, len(text) - maxlen, step)
    x = np.zeros((len(starts), maxlen, len(chars)), dtype=bool)
    y = np.zeros((len(starts), len(chars)), dtype=bool)
    codes = np.fromiter((char_indices[c] for c in text), dtype=np.int64, count=len(text))
    for i, s in enumerate(starts):
        x[i, np.arange(maxlen), codes[s:s + maxlen]] = True
        y[i, codes[s + maxlen]] = True
    return x, y


def load_data(synthetic: bool = False, size: Optional[str] = None) -> Dict[str, Any]:
    """One-hot bool ``x_train`` (N, 40, 57) and ``y_train`` (N, 57); no test set (as the original)."""
    size = common.resolve_size(synthetic, size)
    n_chars = common.pick(SIZES, size)
    if synthetic:
        text = synthetic_text(n_chars)
        chars = list(ALPHABET)
        note = f"synthetic text ({n_chars} chars, {len(chars)} symbols)"
    else:

        import keras

        path = keras.utils.get_file("nietzsche.txt", origin=URL)
        with open(path, encoding="utf-8") as f:
            text = f.read().lower()
        if size != "full":
            text = text[:n_chars]
        chars = sorted(set(text))
        note = f"Nietzsche ({len(text)} chars, {len(chars)} symbols)"
    x, y = vectorize(text, chars)
    return {"x_train": x, "y_train": y, "x_test": None, "y_test": None, "text": text, "chars": chars,
            "config": {"n_chars": len(chars)}, "note": note}


def build_model(n_chars: int = len(ALPHABET), maxlen: int = MAXLEN):
    import keras

    return keras.Sequential([
        keras.Input((maxlen, n_chars)),
        keras.layers.LSTM(128),
        keras.layers.Dense(n_chars, activation="softmax"),
    ], name=NAME)


def compile_args() -> Dict[str, Any]:
    import keras

    return {"loss": "categorical_crossentropy", "optimizer": keras.optimizers.RMSprop(learning_rate=0.01)}


def sample(preds, temperature: float = 1.0) -> int:
    """The original's sampling of an index from a probability array, at a temperature."""
    import numpy as np

    preds = np.asarray(preds).astype("float64")
    preds = np.log(preds + 1e-12) / temperature
    exp_preds = np.exp(preds)
    preds = exp_preds / np.sum(exp_preds)
    return int(np.argmax(np.random.multinomial(1, preds, 1)))


def generate(model, text: str, chars: List[str], length: int = 200, diversity: float = 0.5,
             seed: int = 0) -> str:
    """``length`` characters generated after a random 40-character seed sentence of ``text``."""
    import numpy as np

    rs = np.random.RandomState(seed)
    char_indices = {c: i for i, c in enumerate(chars)}
    start = int(rs.randint(0, len(text) - MAXLEN - 1))
    sentence = text[start:start + MAXLEN]
    out = []
    for _ in range(length):
        x = np.zeros((1, MAXLEN, len(chars)), dtype=np.float32)
        for t, c in enumerate(sentence):
            x[0, t, char_indices[c]] = 1.0
        preds = model(x, training=False)[0]
        nxt = chars[sample(np.asarray(preds), diversity)]
        out.append(nxt)
        sentence = sentence[1:] + nxt
    return text[start:start + MAXLEN] + "|" + "".join(out)


def after_training(model, data: Dict[str, Any], synthetic: bool = False) -> Dict[str, Any]:
    """On real data: print and record a generated sample (the original printed them every epoch)."""
    if synthetic:
        return {}
    text = generate(model, data["text"], data["chars"])
    report.say(f"generated (diversity 0.5): {text!r}")
    return {"sample_text": text}


def run(dir: str, epochs: Optional[int] = None, synthetic: bool = False, size: Optional[str] = None,
        **kwargs: Any) -> Dict[str, Any]:
    """Train with checkpoints in ``dir`` (re-run to resume); per-epoch timings in ``dir/results.*``
    (keyword arguments: see :func:`keepalive.workloads._keras.run_keras`)."""
    from ._keras import run_keras

    return run_keras(sys.modules[__name__], dir, epochs=epochs, synthetic=synthetic, size=size, **kwargs)
