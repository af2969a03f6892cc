"""A Keras 3 ``model.fit(steps_per_epoch=...)`` whose pass over the data outlives an epoch (the Colab TPU
tutorial's shape), for the crash and transparency tests of test_keras_position.py, on any backend
(KERAS_BACKEND). Dropout, Adam, ``shuffle=True`` where the input has it. Prints `STEP n` after each
optimizer step and `COMMITTED n` after each commit; writes every model and optimizer variable to an .npz.

    --data arrays     NumPy arrays, fit(shuffle=True)
    --data pydataset  a keras.utils.PyDataset (fit(shuffle=...) as --shuffle says)
    --data tfdata     tf.data: from_tensor_slices -> shuffle(seed) -> batch -> repeat (TensorFlow only)
    --data fixed      tf.data without shuffle or random ops, no steps_per_epoch (TensorFlow only)
    --data fashion    the fashion_mnist_cnn workload's model and (tiny, synthetic) data as arrays
    --callback ours | none        --no-position: keepalive does not continue the pass (negative control)
    --die-at N                    after step N: wait for the commits, then SIGKILL itself (a kill at a
                                  known place in the pass, whatever the machine's load)
"""
import argparse
import os
import signal
import sys
import threading

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--data", choices=["arrays", "pydataset", "tfdata", "fixed", "fashion"], default="arrays")
p.add_argument("--epochs", type=int, default=5)
p.add_argument("--spe", type=int, default=3, help="steps_per_epoch (0: none)")
p.add_argument("--shuffle", type=int, default=1)
p.add_argument("--callback", choices=["ours", "none"], default="ours")
p.add_argument("--seed", type=int, default=1234)
p.add_argument("--no-position", action="store_true")
p.add_argument("--die-at", type=int, default=0, help="SIGKILL itself after this step, its checkpoints committed")
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

if keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental.enable_op_determinism()

keras.utils.set_random_seed(args.seed)
BATCH = 10
rs = np.random.RandomState(7)  # the data never depends on the training seed
x = rs.normal(size=(100, 12)).astype("float32")
y = ((x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32"))


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return len(x) // BATCH

    def __getitem__(self, i):
        return x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]


if args.data == "fashion":
    from keepalive.workloads import fashion_mnist_cnn as wl

    d = wl.load_data(synthetic=True, size="tiny")
    x = np.asarray(d["x_train"].base, dtype="float32")  # 256 images: 8 batches of 32 per pass
    y = np.asarray(d["y_train"].base, dtype="int32")
    BATCH = d["config"]["batch_size"]
    model = wl.build_model()
    model.compile(**wl.compile_args())
else:
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])

fit_args = {"shuffle": bool(args.shuffle)}
if args.data in ("arrays", "fashion"):
    fit_args.update(x=x, y=y, batch_size=BATCH)
elif args.data == "pydataset":
    fit_args.update(x=Batches())
else:
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if args.data == "tfdata":
        ds = ds.shuffle(len(x), seed=3).batch(BATCH).repeat()
    else:
        ds = ds.map(lambda a, b: (a * 2.0, b)).batch(BATCH).prefetch(2)
    fit_args.update(x=ds)
if args.spe:
    fit_args["steps_per_epoch"] = args.spe


class Steps(keras.callbacks.Callback):
    def __init__(self, ckpt):
        super().__init__()
        self.ckpt, self.epoch = ckpt, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        emit(f"STEP {self.ckpt.step if self.ckpt is not None else self.epoch * (args.spe or 10) + batch + 1}")
        if args.die_at and self.ckpt is not None and self.ckpt.step >= args.die_at:
            self.ckpt.flush()
            os.kill(os.getpid(), signal.SIGKILL)


ckpt = None
callbacks = []
if args.callback == "ours":
    from keepalive.callbacks.keras import DriveCheckpoint

    if args.no_position:  # the negative control: a resume starts a new pass (keepalive before issue 21)
        from keepalive.callbacks import _keras_data

        _keras_data.PassPosition.restore = lambda self, saved: None
    ckpt = DriveCheckpoint(args.run)
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    callbacks.append(ckpt)
callbacks.append(Steps(ckpt))
history = model.fit(epochs=args.epochs, callbacks=callbacks, verbose=0, **fit_args)
if ckpt is not None and not ckpt.finished:
    emit("STOPPED")
    sys.exit(3)
arrays = {f"model.{i}": keras.ops.convert_to_numpy(v.value) for i, v in enumerate(model.variables)}
arrays.update({f"optimizer.{i}": keras.ops.convert_to_numpy(v.value)
               for i, v in enumerate(model.optimizer.variables)})
np.savez(args.out, **arrays)
emit(f"HISTORY {history.epoch}")
emit("DONE")
