"""A Keras 3 training for the crash tests of test_keras_shapes.py: a model WITHOUT known input shapes
(a subclassed model, or a Sequential without keras.Input), ResumableData, EarlyStopping and
ReduceLROnPlateau monitoring the training accuracy (so a lost running metric changes the result),
optionally two fits (transfer learning: the first layer frozen, fit, unfrozen, recompiled, fit
again), ``steps_per_execution`` and a CSVLogger(append=False).

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
p.add_argument("--model", choices=["subclassed", "sequential"], default="subclassed")
p.add_argument("--epochs", default="3", help="epochs per fit: '3' or '2,3' (two fits)")
p.add_argument("--samples", type=int, default=120)
p.add_argument("--batch", type=int, default=10)
p.add_argument("--every", type=int, default=5)
p.add_argument("--spe", type=int, default=1)
p.add_argument("--csv", default="")
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

if keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental.enable_op_determinism()
else:
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

from keepalive.callbacks.keras import DriveCheckpoint, ResumableData  # noqa: E402

keras.utils.set_random_seed(1234)
rs = np.random.RandomState(7)
x = rs.normal(size=(args.samples, 12)).astype("float32")
y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32")


class Net(keras.Model):
    """Subclassed: no input shape until it is called."""

    def __init__(self):
        super().__init__()
        self.base = keras.layers.Dense(24, activation="relu")
        self.drop = keras.layers.Dropout(0.3)
        self.head = keras.layers.Dense(3)

    def call(self, inputs, training=False):
        return self.head(self.drop(self.base(inputs), training=training))


if args.model == "subclassed":
    model = Net()
else:
    model = keras.Sequential([keras.layers.Dense(24, activation="relu"), keras.layers.Dropout(0.3),
                              keras.layers.Dense(3)])
base = model.base if args.model == "subclassed" else model.layers[0]


def compile_model(lr):
    model.compile(optimizer=keras.optimizers.Adam(lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=args.spe)


class Steps(keras.callbacks.Callback):
    def __init__(self, ckpt):
        super().__init__()
        self.ckpt = ckpt

    def on_train_batch_end(self, batch, logs=None):
        emit(f"STEP {self.ckpt.step}")
        if args.die_at and self.ckpt.step >= args.die_at:
            self.ckpt.flush()  # the checkpoints due so far are committed: a kill right after them
            os._exit(9)
        if os.environ.get("KP_DEBUG"):
            it = self.ckpt._fit.get("epoch_iterator")
            emit(f"DBG batch={batch} num={getattr(it, '_num_batches', None)} start={data.start} "
                 f"epoch={data.epoch} offset={self.ckpt._offset}")


ckpt = DriveCheckpoint(args.run, every=args.every)
ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
data = ResumableData(x, y, batch_size=args.batch, seed=5)
histories = []
stages = [int(e) for e in args.epochs.split(",")]
for i, epochs in enumerate(stages):
    if len(stages) > 1:
        base.trainable = i > 0  # stage 1: base frozen; stage 2: everything trains
    compile_model(1e-2 if i == 0 else 3e-3)
    callbacks = [ckpt,
                 keras.callbacks.ReduceLROnPlateau(monitor="accuracy", factor=0.5, patience=0, min_delta=0.01),
                 keras.callbacks.EarlyStopping(monitor="accuracy", patience=1, min_delta=0.01), Steps(ckpt)]
    if args.csv:
        callbacks.insert(1, keras.callbacks.CSVLogger(args.csv, append=False))
    h = model.fit(data, epochs=epochs, callbacks=callbacks, verbose=0)
    histories.append(h)
    emit(f"STAGE_END {i} {ckpt.step}")
    if not ckpt.finished:
        emit("STOPPED")
        sys.exit(3)

arrays = {f"model.{i}": keras.ops.convert_to_numpy(v.value) for i, v in enumerate(model.variables)}
arrays.update({f"optimizer.{i}": keras.ops.convert_to_numpy(v.value)
               for i, v in enumerate(model.optimizer.variables)})
for i, h in enumerate(histories):
    arrays[f"history.{i}.epoch"] = np.asarray(h.epoch)
    arrays.update({f"history.{i}.{k}": np.asarray(v, dtype=np.float64) for k, v in h.history.items()})
arrays["counters"] = np.asarray([ckpt.counters[k] for k in ("epoch", "step", "batch", "samples")])
np.savez(args.out, **arrays)
emit(f"COUNTERS {dict(ckpt.counters)}")
emit("DONE")
