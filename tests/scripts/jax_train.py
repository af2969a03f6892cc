"""The JAX / Flax loops of tests/test_jax_crash.py, as users write them, at the top level of a script.

``--shape``:

* ``nnx``: the Flax NNX MNIST tutorial's shape, small: a CNN with dropout (``nnx.Rngs``),
  ``nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)``, ``nnx.MultiMetric`` (Average + Accuracy),
  an ``@nnx.jit`` train step, a Grain ``DataLoader`` (shuffle, seed), a ``metrics_history`` dict of
  lists logged at each epoch end;
* ``linen``: a Linen MLP with dropout in a ``flax.training.train_state.TrainState``, fed by a torch
  ``DataLoader(shuffle=True)``, the loop's PRNG key ``rng`` split at every step (a top-level variable);
* ``mesh``: the ``nnx`` shape on 8 host devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``
  set by the test): a data-parallel mesh, batches sharded on ``'data'``, parameters replicated.

``--plain`` trains without keepalive (same code, a stand-in with the same loop calls). ``--kill-at
EPOCH:BATCH`` waits, at the start of that batch's body, until the newest save is committed, then
SIGKILLs the process. ``--control X`` switches a piece of keepalive off (a negative control).
``--trace`` (the notice test, ``nnx`` shape): prints ``STEP n`` in each batch's body, then sleeps
``--step-sleep`` seconds, ``COMMITTED n`` per committed checkpoint, and ``STOPPED n`` (at the exit 143
of a stop, no ``--out``) when keepalive stopped the training (a preemption notice), ``DONE`` at the end.
``--out`` gets an ``.npz`` of the final state (every leaf by path, keys as key data), the history and the
step count.
"""
import argparse
import atexit
import os
import signal
import sys
import time

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--shape", required=True, choices=("nnx", "linen", "mesh"))
p.add_argument("--run", default=None)
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--every", default="4")
p.add_argument("--plain", action="store_true")
p.add_argument("--kill-at", default=None)
p.add_argument("--control", default=None, choices=("no-data-state", "no-loop-vars", "no-rngs"))
p.add_argument("--trace", action="store_true")
p.add_argument("--step-sleep", type=float, default=0.0)
args = p.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from keepalive.callbacks._jax_arrays import to_host  # noqa: E402

N, BATCH, SIDE, CLASSES = 96, 16, 8, 10
g = np.random.default_rng(7)
IMAGES = g.normal(size=(N, SIDE, SIDE, 1)).astype(np.float32)
LABELS = g.integers(0, CLASSES, size=N).astype(np.int32)
KILL_AT = tuple(int(v) for v in args.kill_at.split(":")) if args.kill_at else None


class Plain:
    """The loop calls without keepalive (the reference every resumed run must equal)."""

    def __init__(self, state=None, **_):
        self.state = state
        self.extras = {}

    def epochs(self, n):
        return range(n)

    def batches(self, it):
        return iter(it)

    def update(self, state=None):
        self.state = state
        return state

    def flush(self):
        pass


def checkpoint(**objects):
    if args.plain:
        return Plain(**objects)
    from keepalive.callbacks.jax import DriveCheckpoint

    if args.control == "no-data-state":  # the Grain position is not put back: a resumed epoch restarts its order
        from keepalive.callbacks import _jax_data

        opened = _jax_data.Feed.open
        _jax_data.Feed.open = lambda self, start, positioned: opened(
            self, None if start is None else {**start, "state": None}, positioned)
    if args.control == "no-rngs":  # the nnx.Rngs streams are not put back (their keys and counts stay as built)
        from keepalive.callbacks import _jax_objects

        restored = _jax_objects.from_host
        _jax_objects.from_host = lambda template, saved: restored(
            template, {k: (to_host(template)[k] if "rngs/" in k else v) for k, v in saved.items()})
    every = int(args.every) if args.every.isdigit() else args.every
    ckpt = DriveCheckpoint(args.run, every=every, track_globals=args.control != "no-loop-vars", **objects)
    if args.trace:
        ckpt.core.on_commit.append(lambda r: print(f"COMMITTED {r.info.step}", flush=True))
        atexit.register(stopped_at_exit, ckpt)
    return ckpt


def traced_step(ckpt):
    """--trace: the step being run (keepalive counts an NNX loop's step at the batch's end), then a pause
    in which a notice can come."""
    if args.trace:
        print(f"STEP {ckpt.step + 1}", flush=True)
        time.sleep(args.step_sleep)


def stopped_at_exit(ckpt):
    """--trace: a training keepalive stopped (a notice) exits 143 from inside its loop: said at exit."""
    if ckpt.core.stopped:
        print(f"STOPPED {ckpt.step}", flush=True)


def maybe_kill(ckpt, epoch, batch):
    if KILL_AT == (epoch, batch):
        ckpt.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def grain_loader():
    import grain

    class Source:
        def __len__(self):
            return N

        def __getitem__(self, i):
            return {"image": IMAGES[i], "label": LABELS[i]}

    sampler = grain.samplers.IndexSampler(N, shuffle=True, seed=3, num_epochs=1,
                                          shard_options=grain.sharding.NoSharding())
    return grain.DataLoader(data_source=Source(), sampler=sampler, worker_count=0,
                            operations=[grain.transforms.Batch(BATCH, drop_remainder=True)])


class CNN(nnx.Module):
    def __init__(self, *, rngs):
        self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(4 * (SIDE // 2) ** 2, 16, rngs=rngs)
        self.dropout = nnx.Dropout(rate=0.25, rngs=rngs)
        self.linear2 = nnx.Linear(16, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.conv(x)), window_shape=(2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


def loss_fn(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), logits


@nnx.jit
def train_step(model, optimizer, metrics, batch):
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def dump(**trees):
    flat = {}
    for name, tree in trees.items():
        for path, leaf in to_host(tree).items():
            flat[f"{name}/{path}"] = leaf["key_data"] if isinstance(leaf, dict) else np.asarray(leaf)
    np.savez(args.out, **flat)


if args.shape in ("nnx", "mesh"):
    model = CNN(rngs=nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    mesh = None
    if args.shape == "mesh":
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        assert jax.device_count() == 8, jax.devices()
        mesh = Mesh(np.array(jax.devices()), ("data",))
        replicated, by_batch = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
        for obj in (model, optimizer, metrics):
            nnx.update(obj, jax.device_put(nnx.state(obj), replicated))
    loader = grain_loader()
    metrics_history = {"train_loss": [], "train_accuracy": []}
    ckpt = checkpoint(model=model, optimizer=optimizer, metrics=metrics)
    model.train()
    for epoch in ckpt.epochs(args.epochs):
        for i, batch in enumerate(ckpt.batches(loader)):
            maybe_kill(ckpt, epoch, i)
            if mesh is not None:
                batch = jax.device_put(batch, by_batch)
            train_step(model, optimizer, metrics, batch)
            traced_step(ckpt)
        for metric, value in metrics.compute().items():
            metrics_history[f"train_{metric}"].append(value)
        metrics.reset()
    history = np.array([[float(v) for v in vs] for vs in metrics_history.values()])
    if mesh is not None:  # still laid out as the code built it
        assert model.linear1.kernel[...].sharding.is_equivalent_to(replicated, 2)
    dump(model=nnx.to_pure_dict(nnx.state(model)), optimizer=nnx.to_pure_dict(nnx.state(optimizer)),
         metrics=nnx.to_pure_dict(nnx.state(metrics)), history={"h": history})
else:
    import flax.linen as nn
    import torch
    from flax.training import train_state
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1)))
            x = nn.Dropout(0.3, deterministic=not train)(x)
            return nn.Dense(CLASSES)(x)

    @jax.jit
    def linen_step(state, x, y, dropout_rng):
        def loss_of(params):
            logits = state.apply_fn({"params": params}, x, True, rngs={"dropout": dropout_rng})
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), loss

    net = MLP()
    rng = jax.random.key(0)
    rng, init_rng = jax.random.split(rng)
    params = net.init(init_rng, jnp.zeros((1, SIDE, SIDE, 1)), False)["params"]
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(0.01))
    loader = DataLoader(TensorDataset(torch.from_numpy(IMAGES), torch.from_numpy(LABELS)), batch_size=BATCH,
                        shuffle=True)
    losses = []
    ckpt = checkpoint(state=state)
    state = ckpt.state
    for epoch in ckpt.epochs(args.epochs):
        for i, (x, y) in enumerate(ckpt.batches(loader)):
            maybe_kill(ckpt, epoch, i)
            rng, input_rng = jax.random.split(rng)
            state, loss = linen_step(state, x.numpy(), y.numpy(), input_rng)
            ckpt.update(state)
        losses.append(float(loss))
    dump(params=state.params, opt=state.opt_state, step={"step": state.step}, rng={"rng": rng},
         history={"h": np.array(losses)})
if args.trace:
    print("DONE", flush=True)
sys.stdout.flush()
