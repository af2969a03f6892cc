"""A real Keras 3 ``model.fit`` for crash tests: dropout, ``shuffle=True``, Adam, ReduceLROnPlateau and
EarlyStopping (listed after the checkpoint callback). Prints `STEP n` after each optimizer step and
`COMMITTED n` after each checkpoint commit; writes every model and optimizer variable to an .npz.

    --data arrays     x, y NumPy arrays, Keras' own shuffle (epoch-end checkpoints)
    --data resumable  keepalive's ResumableData (checkpoints every --every steps, mid-epoch resume)
    --callback ours | backup (keras.callbacks.BackupAndRestore) | none
"""
import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--samples", type=int, default=320)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--hidden", type=int, default=64)
p.add_argument("--every", default="epoch")
p.add_argument("--data", choices=["arrays", "resumable"], default="arrays")
p.add_argument("--callback", choices=["ours", "backup", "none"], default="ours")
p.add_argument("--seed", type=int, default=1234)
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()

import threading  # noqa: E402
import time  # noqa: E402

from childio import hold_if_planned  # noqa: E402

_out = threading.Lock()


def emit(line):
    """One whole line per write: the writer thread's COMMITTED lines never split a STEP line."""
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
elif keras.backend.backend() == "torch":
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

keras.utils.set_random_seed(args.seed)

rs = np.random.RandomState(7)  # the data itself never depends on the training seed
x = rs.normal(size=(args.samples, 16)).astype("float32")
y = rs.randint(0, 4, size=(args.samples,)).astype("int32")

model = keras.Sequential([
    keras.Input((16,)),
    keras.layers.Dense(args.hidden, activation="relu"),
    keras.layers.Dropout(0.3),
    keras.layers.Dense(args.hidden, activation="relu"),
    keras.layers.BatchNormalization(),
    keras.layers.Dropout(0.3),
    keras.layers.Dense(4),
])
model.compile(optimizer=keras.optimizers.Adam(3e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
steps_per_epoch = -(-args.samples // args.batch)


class Steps(keras.callbacks.Callback):
    """Prints the global step after each optimizer step (and what was resumed, for BackupAndRestore)."""

    def __init__(self, ckpt=None):
        super().__init__()
        self.ckpt = ckpt
        self.epoch = 0
        self.first = True

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if self.first and self.ckpt is None and epoch > 0:
            emit(f"resuming run backup (BackupAndRestore) at epoch {epoch}, step {epoch * steps_per_epoch}")
        self.first = False

    def on_train_batch_end(self, batch, logs=None):
        step = self.ckpt.step if self.ckpt is not None else self.epoch * steps_per_epoch + batch + 1
        emit(f"STEP {step}")
        if args.sleep:
            time.sleep(args.sleep)

    def on_epoch_end(self, epoch, logs=None):
        if self.ckpt is None and args.callback == "backup":
            emit(f"COMMITTED {(epoch + 1) * steps_per_epoch}")


ckpt = None
callbacks = []
if args.callback == "ours":
    from keepalive.callbacks.keras import DriveCheckpoint

    every = int(args.every) if args.every.isdigit() else args.every
    ckpt = DriveCheckpoint(args.run, every=every)
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    callbacks.append(ckpt)
elif args.callback == "backup":
    # Keras' best setting: double_checkpoint falls back to the previous slot when a kill tore the last
    callbacks.append(keras.callbacks.BackupAndRestore(args.run, delete_checkpoint=False,
                                                      double_checkpoint=True))
callbacks += [keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=0.02),
              keras.callbacks.EarlyStopping(monitor="loss", patience=50), Steps(ckpt)]

if args.data == "resumable":
    from keepalive.callbacks.keras import ResumableData

    history = model.fit(ResumableData(x, y, batch_size=args.batch, shuffle=True), epochs=args.epochs,
                        callbacks=callbacks, verbose=0)
else:
    history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=True,
                        callbacks=callbacks, verbose=0)

if ckpt is not None and not ckpt.finished:
    emit("STOPPED")
    sys.exit(3)
arrays = {f"model.{i}.{v.path}": keras.ops.convert_to_numpy(v.value) for i, v in enumerate(model.variables)}
arrays.update({f"optimizer.{i}.{v.path}": keras.ops.convert_to_numpy(v.value)
               for i, v in enumerate(model.optimizer.variables)})
np.savez(args.out, **arrays)
emit(f"EPOCHS_RUN {len(history.epoch)}")
emit(f"HISTORY {history.epoch}")
emit("DONE")
