"""A Keras training whose PyDataset augments with NumPy's global generator, with an unbuilt model (no
``keras.Input``: keepalive looks at one batch to build it before the first step), with or without
keepalive. Writes the final weights, the losses and how often ``__getitem__`` ran to ``--out``.

``--run DIR``: with ``DriveCheckpoint(DIR)``; ``--control``: keepalive's look at the batch leaves the
global generators as the user's code left them (the behaviour before keepalive put them back)."""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KEEPALIVE_PROGRESS", "0")

import keras  # noqa: E402
import numpy as np  # noqa: E402


class Augmenting(keras.utils.PyDataset):
    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch
        self.calls = 0

    def __len__(self):
        return len(self.x) // self.batch

    def __getitem__(self, i):
        self.calls += 1
        rows = slice(i * self.batch, (i + 1) * self.batch)
        noise = np.random.normal(0.0, 0.1, self.x[rows].shape).astype("float32")  # the global generator
        return self.x[rows] + noise, self.y[rows]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--run")
    p.add_argument("--control", action="store_true")
    a = p.parse_args()
    keras.utils.set_random_seed(0)
    g = np.random.default_rng(1)
    x, y = g.normal(size=(64, 6)).astype("float32"), g.integers(0, 3, 64)
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.2),
                              keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = Augmenting(x, y, 8)
    callbacks = []
    if a.run:
        from keepalive.callbacks import _keras_data
        from keepalive.callbacks.keras import DriveCheckpoint

        if a.control:
            _keras_data._peek = lambda fetch: fetch()
        callbacks.append(DriveCheckpoint(a.run))
    history = model.fit(data, epochs=2, verbose=0, callbacks=callbacks, shuffle=False)
    weights = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    np.savez(a.out, calls=data.calls, loss=np.asarray(history.history["loss"]), **weights)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
