"""What it costs to put a resumed Keras ``fit(steps_per_epoch=...)`` back at 90 % of its pass over the
data, against starting a fresh pass, per input shape (issue 21, Keras part).

    python benchmarks/keras_data_position.py [--samples 1000000] [--batch 128] [--repeats 3]

Each figure is the time until the first batch after the position is available (median of repeats), and
its ratio to a fresh pass's first batch (same input, no skip). Shapes:

* ``arrays/jax``  NumPy arrays on the JAX backend, ``shuffle=True``: keepalive's ``PassPosition`` draws
  the pass's permutation from the saved NumPy state and skips the consumed batches by index (nothing is
  sliced);
* ``arrays/tf``  NumPy arrays on the TensorFlow backend (Keras' tf.data pipeline, a global seed): the
  consumed batches are drawn from a fresh iterator (an in-memory gather each);
* ``tf.data``  ``from_tensor_slices -> shuffle(10000, seed) -> map -> batch -> repeat``: the same by
  drawing, against ``tf.train.Checkpoint(iterator=...)``: its save (at every checkpoint, shuffle buffer
  included) and its restore into a fresh iterator.

The JAX shape runs in a child process (the backend is chosen at import). Not part of the test suite.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _epoch_iterator(x, y, batch, steps):
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        from keras.src.backend.tensorflow.trainer import TFEpochIterator

        return TFEpochIterator(x=x, y=y, batch_size=batch, steps_per_epoch=steps, shuffle=True,
                               distribute_strategy=tf.distribute.get_strategy())
    from keras.src.backend.jax.trainer import JAXEpochIterator

    return JAXEpochIterator(x=x, y=y, batch_size=batch, steps_per_epoch=steps, shuffle=True)


def arrays(args):
    """A fresh pass's first batch vs a pass positioned at 90 % by keepalive (this process's backend)."""
    from keepalive.callbacks._keras_data import PassPosition, _host_rngs

    keras.utils.set_random_seed(1)
    x = np.random.RandomState(0).normal(size=(args.samples, 16)).astype("float32")
    y = np.zeros(args.samples, dtype="int32")
    n = -(-args.samples // args.batch)
    skip = int(0.9 * n)
    it = _epoch_iterator(x, y, args.batch, 100)

    def fresh():
        next(iter(it._get_iterator()))

    pos = PassPosition(it, None)
    saved = {"position": skip, "rng": _host_rngs()}

    def positioned():
        pos.restore(saved)
        next(it._current_iterator)

    f, p = _median_time(fresh, args.repeats), _median_time(positioned, args.repeats)
    pos.unbind()
    return f"arrays/{keras.backend.backend()}: {args.samples} samples, {n} batches, skip {skip}: fresh pass " \
           f"{f * 1e3:.1f} ms, positioned {p * 1e3:.1f} ms, ratio {p / f:.2f}"


def tfdata(args):
    import tensorflow as tf

    x = np.random.RandomState(0).normal(size=(args.samples, 16)).astype("float32")
    ds = (tf.data.Dataset.from_tensor_slices(x).shuffle(10000, seed=3).map(lambda v: v * 2.0)
          .batch(args.batch).repeat())
    n = -(-args.samples // args.batch)
    skip = int(0.9 * n)

    def fresh():
        next(iter(ds))

    def drawn():
        it = iter(ds)
        for _ in range(skip + 1):
            next(it)

    it = iter(ds)
    for _ in range(skip):
        next(it)
    folder = tempfile.mkdtemp()
    ckpt = tf.train.Checkpoint(iterator=it)
    prefix = os.path.join(folder, "it")

    def save():
        ckpt.write(prefix)

    def restore():
        fresh_it = iter(ds)
        tf.train.Checkpoint(iterator=fresh_it).read(prefix).assert_consumed()
        next(fresh_it)

    f, d = _median_time(fresh, args.repeats), _median_time(drawn, args.repeats)
    s, r = _median_time(save, args.repeats), _median_time(restore, args.repeats)
    size = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))
    return (f"tf.data (shuffle buffer 10000): {n} batches, skip {skip}: fresh pass {f * 1e3:.1f} ms; drawn "
            f"{d * 1e3:.0f} ms (ratio {d / f:.1f}); tf.train.Checkpoint(iterator) save {s * 1e3:.1f} ms at "
            f"every checkpoint ({size / 2**20:.1f} MiB), restore {r * 1e3:.1f} ms (ratio {r / f:.1f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["arrays"], default=None)
    args = ap.parse_args()
    if args.only:
        print(arrays(args))
        return
    env = dict(os.environ, KERAS_BACKEND="jax")
    child = subprocess.run([sys.executable, __file__, "--only", "arrays", "--samples", str(args.samples),
                            "--batch", str(args.batch), "--repeats", str(args.repeats)], env=env,
                           capture_output=True, text=True)
    print(child.stdout.strip() or child.stderr[-2000:])
    print(arrays(args))
    print(tfdata(args))


if __name__ == "__main__":
    main()
