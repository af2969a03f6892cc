"""Epoch-time overhead of per-epoch checkpointing in Keras 3: keepalive's DriveCheckpoint against
``keras.callbacks.BackupAndRestore``, on a small CNN (the mnist_cnn workload's shape: Conv32-Conv64-
MaxPool-Dropout-Dense128-Dropout-Dense10, Adadelta) with synthetic MNIST-shaped data.

    python benchmarks/keras_overhead.py [--samples 6144] [--epochs 5] [--repeats 3] [--dir /tmp/x]

For each repeat the three configurations take turns (no checkpoint, DriveCheckpoint every epoch,
BackupAndRestore every epoch; fresh model each time, same seed). An epoch's time runs from one
``on_epoch_begin`` to the next, so it includes every callback's epoch-end work (the save); the first
epoch of each fit (tracing) is left out. Printed per configuration:

* ``epoch``     the median epoch time and its overhead against "none" (end to end: includes the
                background write competing for the CPU);
* ``blocking``  the median time the checkpoint callback itself held the training loop per epoch
                (our host-memory snapshot vs. BackupAndRestore's synchronous .h5 write), and that as a
                share of the epoch: the overhead the callback causes directly, free of run-to-run noise;
* ``write``     (ours) the background commit time of one checkpoint, until it is durable.

On a shared VM end-to-end epoch times vary by several percent between runs; the blocking share is the
stable figure. Goal: <= 1 % per-epoch overhead. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KEEPALIVE_PROGRESS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keepalive.callbacks.keras import DriveCheckpoint  # noqa: E402


def build_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Dropout(0.25),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.Adadelta(1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


class EpochClock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.begins = []

    def on_epoch_begin(self, epoch, logs=None):
        self.begins.append(time.perf_counter())

    def on_train_end(self, logs=None):
        self.begins.append(time.perf_counter())

    def epoch_times(self):
        return [b - a for a, b in zip(self.begins, self.begins[1:])]


def timed(obj, names, sink):
    """Wrap the methods ``names`` of ``obj`` so their wall time adds up in ``sink`` (one per epoch)."""
    for name in names:
        fn = getattr(obj, name)

        def wrapper(*a, _fn=fn, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                sink[-1] += time.perf_counter() - t0

        setattr(obj, name, wrapper)


def run_one(kind, x, y, args, workdir):
    model = build_model(args.seed)
    clock = EpochClock()
    blocking = [0.0]
    writes = []

    class Split(keras.callbacks.Callback):  # starts a new blocking-time slot per epoch
        def on_epoch_begin(self, epoch, logs=None):
            blocking.append(0.0)

    callbacks = [Split()]
    if kind == "keepalive":
        ckpt = DriveCheckpoint(os.path.join(workdir, "ka"), every="epoch", quiet=True)
        ckpt.core.on_commit.append(lambda r: writes.append(r.seconds))
        timed(ckpt, ["on_train_batch_end", "on_train_batch_begin", "on_epoch_begin", "_epoch_end",
                     "on_train_begin", "_late_train_begin"], blocking)
        callbacks.append(ckpt)
    elif kind == "BackupAndRestore":
        bnr = keras.callbacks.BackupAndRestore(os.path.join(workdir, "bnr"), delete_checkpoint=False)
        timed(bnr, ["on_epoch_end", "on_train_batch_end", "on_train_begin"], blocking)
        callbacks.append(bnr)
    callbacks.append(clock)
    model.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=True, verbose=0, callbacks=callbacks)
    # epoch 0 carries tracing; the blocking slot of epoch e closes when epoch e+1 begins
    times = clock.epoch_times()[1:]
    block = blocking[2:2 + len(times)]
    shutil.rmtree(os.path.join(workdir, "ka"), ignore_errors=True)
    shutil.rmtree(os.path.join(workdir, "bnr"), ignore_errors=True)
    return times, block, writes[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=6144)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a fresh temp dir)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = p.parse_args()

    rs = np.random.RandomState(0)
    y = rs.randint(0, 10, size=args.samples).astype("int32")
    x = (rs.normal(size=(10, 28, 28, 1))[y] + rs.normal(size=(args.samples, 28, 28, 1))).astype("float32")
    workdir = args.dir or tempfile.mkdtemp(prefix="keras-overhead-")
    kinds = ["none", "keepalive", "BackupAndRestore"]
    epochs = {k: [] for k in kinds}
    blocks = {k: [] for k in kinds}
    writes = []
    for r in range(args.repeats):
        for kind in kinds:
            t, b, w = run_one(kind, x, y, args, workdir)
            epochs[kind] += t
            blocks[kind] += b
            writes += w
            print(f"repeat {r + 1}/{args.repeats} {kind:17s} median epoch {statistics.median(t):.3f} s",
                  file=sys.stderr, flush=True)
    base = statistics.median(epochs["none"])
    n_params = build_model(args.seed).count_params()
    print(f"\nsmall CNN ({n_params:,} parameters, about {n_params * 4 * 3 / 2**20:.1f} MiB with the "
          f"Adadelta state), {args.samples} samples x {args.epochs} epochs, batch {args.batch}, "
          f"keras {keras.__version__} ({keras.backend.backend()}), {args.repeats} repeats")
    print(f"{'configuration':18s} {'median epoch':>13s} {'overhead':>9s} {'blocking/epoch':>15s} "
          f"{'share':>7s}")
    out = {}
    for kind in kinds:
        med = statistics.median(epochs[kind])
        blk = statistics.median(blocks[kind]) if kind != "none" else 0.0
        out[kind] = {"median_epoch_s": med, "overhead_pct": 100 * (med - base) / base,
                     "blocking_s": blk, "blocking_pct": 100 * blk / med}
        print(f"{kind:18s} {med:12.3f}s {out[kind]['overhead_pct']:8.2f}% {1000 * blk:13.1f}ms "
              f"{out[kind]['blocking_pct']:6.2f}%")
    if writes:
        out["keepalive"]["background_write_s"] = statistics.median(writes)
        print(f"keepalive background write (until durable), median: "
              f"{1000 * statistics.median(writes):.1f} ms")
    if args.json:
        print(json.dumps(out, indent=2))
    if not args.dir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
