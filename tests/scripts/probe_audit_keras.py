"""The Keras part of tests/test_probe_audit.py, in one interpreter per backend (``KERAS_BACKEND``).

Trains a small model on an augmenting ``PyDataset`` without keepalive and with it (``every=3``: saves
inside epochs), twice: a model built by ``keras.Input`` and an unbuilt one (keepalive looks at one
batch to build it before loading a checkpoint into it). Prints one JSON line: per shape, where the
calls into the dataset (``__len__`` left out) part, whether the only extra call is the documented peek,
how many more ``__len__`` calls were made; and whether the weights are bit-identical."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KEEPALIVE_PROGRESS", "0")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from probe_audit import Probe, augment, first_difference  # noqa: E402


class Counted(keras.utils.PyDataset):
    def __init__(self, probe, x, y, batch):
        super().__init__()
        self.probe, self.x, self.y, self.batch = probe, x, y, batch

    def __len__(self):
        self.probe.note("__len__")
        return len(self.x) // self.batch

    def __getitem__(self, i):
        self.probe.note("__getitem__")
        rows = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[rows] + np.float32(augment()), self.y[rows]


def train(run, built):
    keras.utils.set_random_seed(0)
    probe = Probe()
    g = np.random.default_rng(1)
    x, y = g.normal(size=(48, 6)).astype("float32"), g.integers(0, 3, 48)
    layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.2), keras.layers.Dense(3)]
    model = keras.Sequential(([keras.Input((6,))] if built else []) + layers)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = []
    if run:
        from keepalive.callbacks.keras import DriveCheckpoint

        callbacks.append(DriveCheckpoint(run, every=3, quiet=True))
    model.fit(Counted(probe, x, y, 8), epochs=2, verbose=0, callbacks=callbacks)
    return probe, [np.asarray(w) for w in model.get_weights()]


def compare(tmp, built):
    (p0, w0), (p1, w1) = train(None, built), train(os.path.join(tmp, f"run-{built}"), built)
    e0, e1 = ([e for e in p.events if e[0] != "__len__"] for p in (p0, p1))
    difference, peek = first_difference(e0, e1), False
    if difference is not None:
        # the documented peek (fit's input looked at to build the model and its compiled metrics
        # before a checkpoint loads into them): one __getitem__ more, then the same calls and states
        at = next(i for i, (a, b) in enumerate(zip(e0 + [None], e1)) if a != b)
        peek = e1[at][0] == "__getitem__" and e1[:at] + e1[at + 1:] == e0
    same = len(w0) == len(w1) and all(np.array_equal(a, b) for a, b in zip(w0, w1))
    return {"difference": difference, "peek": peek, "counts": [p0.counts(), p1.counts()],
            "extra_len": p1.counts().get("__len__", 0) - p0.counts().get("__len__", 0)}, same


def main():
    tmp = sys.argv[1]
    shapes, equal = {}, True
    for built in (True, False):
        shapes["built" if built else "unbuilt"], same = compare(tmp, built)
        equal = equal and same
    print(json.dumps({"backend": keras.backend.backend(), "shapes": shapes, "weights_equal": equal}), flush=True)


if __name__ == "__main__":
    main()
