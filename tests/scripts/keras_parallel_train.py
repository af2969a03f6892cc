"""Keras 3 on the JAX backend under ``keras.distribution.DataParallel`` over 8 host devices (the
Kaggle v5e-8 shape, on CPU through ``XLA_FLAGS=--xla_force_host_platform_device_count=8``), for the
crash tests of tests/test_keras_jax_parallel.py. A small model with Dropout and Adam fits
``ResumableData`` (shuffled per epoch: resumable inside an epoch; ``--data resumable``) or NumPy
arrays with Keras' own shuffle (``--data arrays``: the same script runs without keepalive). Prints ``STEP n`` after each
optimizer step and ``COMMITTED n`` after each checkpoint commit; writes every model and optimizer
variable and the fit's History to an .npz.

    --callback ours | none    with keepalive's DriveCheckpoint(every=--every), or without keepalive
    --no-position             the control: the checkpoint's data position is dropped on resume
"""
import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--samples", type=int, default=192)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--every", default="4")
p.add_argument("--callback", choices=["ours", "none"], default="ours")
p.add_argument("--data", choices=["resumable", "arrays"], default="resumable")
p.add_argument("--no-position", action="store_true")
args = p.parse_args()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from childio import emit  # noqa: E402

devices = keras.distribution.list_devices()
assert len(devices) == 8, devices
keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
keras.utils.set_random_seed(1234)

rs = np.random.RandomState(7)  # the data never depends on the training's seed
x = rs.normal(size=(args.samples, 12)).astype("float32")
y = rs.randint(0, 3, size=(args.samples,)).astype("int32")

model = keras.Sequential([
    keras.Input((12,)),
    keras.layers.Dense(32, activation="relu"),
    keras.layers.Dropout(0.25),
    keras.layers.Dense(3),
])
model.compile(optimizer=keras.optimizers.Adam(1e-2),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])


class Steps(keras.callbacks.Callback):
    """Prints the global step after each optimizer step."""

    def __init__(self, ckpt=None):
        super().__init__()
        self.ckpt, self.epoch = ckpt, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        steps_per_epoch = -(-args.samples // args.batch)
        emit(f"STEP {self.ckpt.step if self.ckpt is not None else self.epoch * steps_per_epoch + batch + 1}")


from keepalive.callbacks.keras import DriveCheckpoint, ResumableData  # noqa: E402

ckpt = None
callbacks = []
if args.callback == "ours":
    every = int(args.every) if args.every.isdigit() else args.every
    ckpt = DriveCheckpoint(args.run, every=every)
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    if args.no_position:
        # the control: a resumed epoch starts at its first batch instead of the saved one (all else
        # restored): it trains the epoch's first batches again, not the ones the kill left
        plan = ResumableData.plan
        ResumableData.plan = lambda self, epoch, start=0: plan(self, epoch, 0)
    callbacks.append(ckpt)
callbacks.append(Steps(ckpt))

if args.data == "resumable":
    history = model.fit(ResumableData(x, y, batch_size=args.batch, shuffle=True), epochs=args.epochs,
                        callbacks=callbacks, verbose=0)
else:  # Keras' own shuffle, the same in a script without keepalive (ResumableData is keepalive's)
    history = model.fit(x, y, batch_size=args.batch, shuffle=True, epochs=args.epochs, callbacks=callbacks,
                        verbose=0)

if ckpt is not None and not ckpt.finished:
    emit("STOPPED")
    sys.exit(3)
arrays = {f"model.{i}": keras.ops.convert_to_numpy(v.value) for i, v in enumerate(model.variables)}
arrays.update({f"optimizer.{i}": keras.ops.convert_to_numpy(v.value) for i, v in enumerate(model.optimizer.variables)})
arrays.update({f"history.{k}": np.asarray(v, dtype=np.float64) for k, v in history.history.items()})
arrays["history.epoch"] = np.asarray(history.epoch)
sharding = model.variables[0].value.sharding
emit(f"SHARDING {type(sharding).__name__} devices={len(sharding.device_set)}")
np.savez(args.out, **arrays)
emit("DONE")
