"""A Keras 3 transfer-learning script for tests/test_keras_stages.py, written as people copy the README:
a NEW ``DriveCheckpoint(path)`` inline in each ``fit`` (same path). Fit 1 trains the head (first layer
frozen); then the first layer is unfrozen, the model recompiled with a lower learning rate (or not:
``--same-optimizer``) and fit 2 trains everything. Plain arrays, ``shuffle=True``, Dropout,
ReduceLROnPlateau: exact at epoch ends with ``keras.utils.set_random_seed``.

``--fits 2`` runs fit 2 only (fit 1 commented out on a re-run); ``--plain`` runs without keepalive (the
reference); ``--die-at N`` exits at once after global step N, its due checkpoints committed (a kill).

Prints `STEP n` after each optimizer step (the run's global step) and `COMMITTED n` after each commit;
writes every model and optimizer variable, each fit's History and the counters to an .npz.
"""
import argparse
import os
import sys
import threading

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--fits", default="1,2", help="which fits run: '1,2', or '2' (fit 1 commented out)")
p.add_argument("--epochs", default="2,3", help="epochs of fit 1 and fit 2")
p.add_argument("--lr2", type=float, default=3e-3, help="fit 2's learning rate (recompiled)")
p.add_argument("--same-optimizer", action="store_true", help="fit 2 without recompiling")
p.add_argument("--plain", action="store_true", help="without keepalive")
p.add_argument("--die-at", type=int, default=0, help="exit at once (as if killed) after this step")
args = p.parse_args()

from childio import hold_if_planned  # noqa: E402

_out = threading.Lock()


def emit(line):
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    hold_if_planned(line)  # outside the lock: the writer thread's lines still come


import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.experimental.enable_op_determinism()

from keepalive.callbacks.keras import DriveCheckpoint  # noqa: E402

keras.utils.set_random_seed(1234)
rs = np.random.RandomState(7)
x = rs.normal(size=(120, 12)).astype("float32")
y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32")

model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(24, activation="relu"),
                          keras.layers.Dropout(0.3), keras.layers.Dense(3)])
steps = {"global": 0}


def compile_model(lr):
    model.compile(optimizer=keras.optimizers.Adam(lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])


class Steps(keras.callbacks.Callback):
    def __init__(self, ckpt):
        super().__init__()
        self.ckpt = ckpt

    def on_train_batch_end(self, batch, logs=None):
        if self.ckpt is None:
            steps["global"] += 1
        step = steps["global"] if self.ckpt is None else self.ckpt.step
        emit(f"STEP {step}")
        if args.die_at and step >= args.die_at:
            self.ckpt.flush()  # the checkpoints due so far are committed: a kill right after them
            os._exit(9)


def fit(epochs):
    ckpt = None
    if not args.plain:
        ckpt = DriveCheckpoint(args.run)  # a new callback per fit, the same path
        ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    callbacks = [keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=0.02),
                 Steps(ckpt)]
    h = model.fit(x, y, batch_size=10, epochs=epochs, callbacks=([ckpt] if ckpt else []) + callbacks, verbose=0)
    return h, ckpt


fits = [int(f) for f in args.fits.split(",")]
epochs = [int(e) for e in args.epochs.split(",")]
histories = {}
ckpt = None
if 1 in fits:
    model.layers[0].trainable = False
    compile_model(1e-2)
    histories[1], ckpt = fit(epochs[0])
    emit(f"FIT_END 1 {ckpt.step if ckpt else steps['global']}")
if 2 in fits:
    model.layers[0].trainable = True
    if not args.same_optimizer or 1 not in fits:
        compile_model(args.lr2 if not args.same_optimizer else 1e-2)
    histories[2], ckpt = fit(epochs[1])
    emit(f"FIT_END 2 {ckpt.step if ckpt else steps['global']}")

arrays = {f"model.{i}": keras.ops.convert_to_numpy(v.value) for i, v in enumerate(model.variables)}
arrays.update({f"optimizer.{i}": keras.ops.convert_to_numpy(v.value)
               for i, v in enumerate(model.optimizer.variables)})
for i, h in histories.items():
    arrays[f"history.{i}.epoch"] = np.asarray(h.epoch)
    arrays.update({f"history.{i}.{k}": np.asarray(v, dtype=np.float64) for k, v in h.history.items()})
arrays["steps"] = np.asarray([ckpt.step if ckpt else steps["global"]])
np.savez(args.out, **arrays)
emit("DONE")
