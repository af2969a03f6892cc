"""What a checkpoint costs a JAX training step: keepalive's save vs Orbax's async CheckpointManager.

The state is an optax pytree on CPU: an MLP's parameters (``--size-mb`` / 3 of float32) and its Adam
moments (the other two thirds), trained by one jitted step that donates both
(``jax.jit(..., donate_argnums=(0, 1))``: the buffers of the state a save was handed are deleted by
the next step). A save is made between two steps, side by side in one run, alternating:

* keepalive: ``keepalive.core.Checkpointer.save`` with a ``capture`` that returns the state's leaves as
  ``jax.Array``\\ s (a lazy snapshot: each leaf's host transfer starts in the save, the copy into the
  host buffer runs in the writer's thread, and the loop settles it before the next step, as the JAX
  adapter does at each step boundary); also with ``snapshot="blocking"`` (the copy inside ``save()``);
* Orbax: ``CheckpointManager`` with async checkpointing, ``save(step, args=ocp.args.StandardSave(state))``;
* keepalive's JAX adapter (``keepalive.callbacks.jax.DriveCheckpoint``, the state registered as a
  functional state, ``ckpt.update(state)`` then ``ckpt.save()``), where it exists.

Per save: ``save()`` = the time inside the save call; ``stall`` = that + the excess of the next step
(its settle included) over the median clean step; ``x step`` = stall / clean step. The write to disk
runs on in the background; ``left`` is what of it still ran after that step (waited for outside the
timings, before the next save).

Then resume, from the newest checkpoint to the state back on the device, ready to train:
keepalive (find, verify every byte's checksum, read, ``jax.device_put`` each leaf) vs Orbax
``restore(step, args=ocp.args.StandardRestore(abstract_state))``.

    python benchmarks/jax_save.py [--size-mb 384] [--batch 64] [--repeat 5] [--dir /tmp/x] [--quick]

``--quick``: a 96 MB state, 3 saves of each kind (< 30 s). No asserts: it prints figures and ratios.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from keepalive.core import Checkpointer  # noqa: E402

LAYERS = 4


def build(size_mb: int, batch: int) -> Tuple[Any, Any, Callable[..., Any], Tuple[Any, Any]]:
    """Parameters, Adam state, the jitted donating step and one batch. Parameters are a third of the
    state (Adam keeps two moments of the same size)."""
    n = int((size_mb * 1e6 / 3 / 4 / LAYERS) ** 0.5)
    keys = jax.random.split(jax.random.key(0), LAYERS + 2)
    params = {f"layer{i}": {"w": jax.random.normal(keys[i], (n, n), jnp.float32) / np.sqrt(n),
                            "b": jnp.zeros((n,), jnp.float32)} for i in range(LAYERS)}
    tx = optax.adam(1e-4)
    opt_state = tx.init(params)
    x = jax.random.normal(keys[-2], (batch, n), jnp.float32)
    y = jax.random.normal(keys[-1], (batch, n), jnp.float32)

    def loss(p: Any, xb: Any, yb: Any) -> Any:
        h = xb
        for i in range(LAYERS):
            h = jnp.tanh(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
        return jnp.mean((h - yb) ** 2)

    def step(p: Any, s: Any, xb: Any, yb: Any) -> Tuple[Any, Any]:
        grads = jax.grad(loss)(p, xb, yb)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    return params, opt_state, jax.jit(step, donate_argnums=(0, 1)), (x, y)


def state_bytes(state: Any) -> int:
    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(state))


class Loop:
    """The training loop's state, rebound at each step as a JAX loop does."""

    def __init__(self, size_mb: int, batch: int):
        self.params, self.opt, self._step, self.batch = build(size_mb, batch)
        self.treedef = jax.tree.structure((self.params, self.opt))

    @property
    def state(self) -> Tuple[Any, Any]:
        return self.params, self.opt

    def step(self) -> float:
        t0 = time.perf_counter()
        self.params, self.opt = self._step(self.params, self.opt, *self.batch)
        jax.block_until_ready(self.params)
        return time.perf_counter() - t0

    def clean(self, n: int = 3) -> float:
        return statistics.median(self.step() for _ in range(n))


# --------------------------------------------------------------------------------- the savers
class Keepalive:
    """keepalive's save through the core, the state's leaves handed over as jax arrays."""

    def __init__(self, root: str, loop: Loop, snapshot: str):
        self.loop, self.name = loop, f"keepalive ({snapshot})"
        self.run = os.path.join(root, f"keepalive-{snapshot}")
        self.ckpt = Checkpointer(self.run, quiet=True, keep=2, snapshot=snapshot)
        self.ckpt.load()
        # the JAX adapter's contract: a lazy source registered, the copy settled before each step
        self.ckpt.lazy_sources.append(lambda: ())

    def save(self, step: int) -> None:
        self.ckpt.counters["step"] = step
        leaves = jax.tree.leaves(self.loop.state)
        self.ckpt.save(lambda: {"objects": {"leaves": leaves}}, reason="benchmark")

    def before_step(self) -> None:
        self.ckpt.settle_snapshot()

    def finish(self) -> None:
        self.ckpt.writer.wait()

    def close(self) -> None:
        self.ckpt.close()

    def restore(self) -> Tuple[Any, Any]:
        fresh = Checkpointer(self.run, quiet=True, keep=2)
        tree = fresh.load()
        fresh.close()
        assert tree is not None
        leaves = [jax.device_put(v) for v in tree["objects"]["leaves"]]
        return jax.block_until_ready(jax.tree.unflatten(self.loop.treedef, leaves))


class Adapter:
    """``keepalive.callbacks.jax.DriveCheckpoint`` with the state registered as a functional state
    (``ckpt.update(state)`` after each step, ``ckpt.save()`` by hand): whatever its capture hands the
    store (host copies or ``jax.Array`` leaves)."""

    def __init__(self, root: str, loop: Loop):
        from keepalive.callbacks.jax import DriveCheckpoint

        self.cls, self.loop, self.name = DriveCheckpoint, loop, "keepalive jax adapter"
        self.run = os.path.join(root, "adapter")
        self.ckpt = DriveCheckpoint(self.run, state=loop.state, every=10**9, keep=2, quiet=True)
        self.ckpt.resume()

    def save(self, step: int) -> None:
        self.ckpt.update(self.loop.state)
        self.ckpt.save()

    def before_step(self) -> None:
        self.ckpt.core.settle_snapshot()

    def finish(self) -> None:
        self.ckpt.core.writer.wait()

    def close(self) -> None:
        self.ckpt.close()

    def restore(self) -> Tuple[Any, Any]:
        fresh = self.cls(self.run, state=self.loop.state, keep=2, quiet=True)
        fresh.resume()
        state = jax.block_until_ready(fresh.state)
        fresh.close()
        return state


class Orbax:
    """Orbax's CheckpointManager, async, as Flax's guide uses it."""

    def __init__(self, root: str, loop: Loop):
        import orbax.checkpoint as ocp

        self.ocp, self.loop, self.name = ocp, loop, "orbax (async)"
        self.dir = os.path.join(root, "orbax")
        options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
        self.mngr = ocp.CheckpointManager(self.dir, options=options)

    def save(self, step: int) -> None:
        self.mngr.save(step, args=self.ocp.args.StandardSave(self.loop.state))

    def before_step(self) -> None:
        pass

    def finish(self) -> None:
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.wait_until_finished()
        self.mngr.close()

    def restore(self) -> Tuple[Any, Any]:
        mngr = self.ocp.CheckpointManager(self.dir)
        abstract = jax.tree.map(self.ocp.utils.to_shape_dtype_struct, self.loop.state)
        state = mngr.restore(mngr.latest_step(), args=self.ocp.args.StandardRestore(abstract))
        mngr.close()
        return jax.block_until_ready(state)


# ------------------------------------------------------------------------------- measurements
def measure(loop: Loop, savers: List[Any], repeat: int) -> Dict[str, Dict[str, List[float]]]:
    """Saves of each saver between two steps, alternating (a shared machine's load drifts:
    neighbours see the same); the first save of each (buffers, threads, folders made) left out."""
    out = {s.name: {"save": [], "stall": [], "clean": [], "write": []} for s in savers}
    step = 0
    for i in range(repeat + 1):
        for saver in (savers if i % 2 == 0 else savers[::-1]):
            clean = loop.clean()
            step += 1
            t0 = time.perf_counter()
            saver.save(step)
            saved = time.perf_counter() - t0
            saver.before_step()
            after = time.perf_counter() - t0 - saved + loop.step()
            t1 = time.perf_counter()
            saver.finish()
            if i:
                r = out[saver.name]
                r["save"].append(saved)
                r["stall"].append(saved + after - clean)
                r["clean"].append(clean)
                r["write"].append(time.perf_counter() - t1)
    return out


def same(a: Any, b: Any) -> bool:
    """Bit for bit, leaf by leaf."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


def resume_times(loop: Loop, savers: List[Any], repeat: int) -> Dict[str, float]:
    want = jax.tree.map(np.asarray, loop.state)  # what the newest saves hold
    out = {}
    for saver in savers:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            state = saver.restore()
            times.append(time.perf_counter() - t0)
        out[saver.name] = statistics.median(times)
        if not same(want, state):
            print(f"  note: {saver.name} restored a state that differs from the one saved")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=384, help="state size (MB): parameters + Adam moments")
    ap.add_argument("--batch", type=int, default=64, help="rows of the step's batch (sets the step time)")
    ap.add_argument("--repeat", type=int, default=5, help="saves of each kind (after one left out)")
    ap.add_argument("--dir", default=None, help="folder to write to (default: a temp folder)")
    ap.add_argument("--quick", action="store_true", help="96 MB, 3 saves of each kind: < 30 s")
    args = ap.parse_args()
    if args.quick:
        args.size_mb, args.repeat = 96, 3
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax logs each save at INFO
    root = args.dir or tempfile.mkdtemp(prefix="keepalive-jax-bench-")
    os.makedirs(root, exist_ok=True)
    loop = Loop(args.size_mb, args.batch)
    loop.clean(2)  # compiled
    nbytes = state_bytes(loop.state)
    print(f"state: {nbytes / 1e6:.0f} MB in {len(jax.tree.leaves(loop.state))} arrays on "
          f"{jax.devices()[0].platform} ({jax.device_count()} device(s)), batch {args.batch}, "
          f"jax {jax.__version__}, load average {os.getloadavg()[0]:.2f}", flush=True)
    savers: List[Any] = [Keepalive(root, loop, "lazy"), Keepalive(root, loop, "blocking"), Orbax(root, loop)]
    try:
        savers.append(Adapter(root, loop))
    except ImportError:  # an older keepalive without the JAX adapter
        pass
    res = measure(loop, savers, args.repeat)
    med = statistics.median
    print(f"\nper save (median of {args.repeat}, range in brackets)")
    print(f"{'':22s} {'step ms':>8s} {'save() ms':>10s} {'stall ms':>18s} {'x step':>7s} {'left ms':>8s}")
    for name, r in res.items():
        st = r["stall"]
        print(f"{name:22s} {1000 * med(r['clean']):8.1f} {1000 * med(r['save']):10.1f} "
              f"{1000 * med(st):7.1f} ({1000 * min(st):4.0f}-{1000 * max(st):4.0f}) "
              f"{med(st) / med(r['clean']):7.2f} {1000 * med(r['write']):8.0f}", flush=True)
    print("stall = save() + (the next step, its settle included - clean step); left = the write still "
          "running after that step (waited for outside the timings)")
    step = 10 * (args.repeat + 2)
    for saver in savers:  # one more save of each, of the state as it is now: what each resume must give
        saver.save(step)
        saver.before_step()
        saver.finish()
    resumes = resume_times(loop, savers, max(2, args.repeat // 2))
    print(f"\nresume (median of {max(2, args.repeat // 2)}): newest checkpoint -> the state on the device")
    for name, seconds in resumes.items():
        print(f"{name:22s} {1000 * seconds:8.1f} ms  {nbytes / 1e9 / seconds:6.2f} GB/s")
    lazy, orbax = res[savers[0].name], res[savers[2].name]
    print(f"\nratio stall keepalive (lazy) / orbax (async) = {med(lazy['stall']) / med(orbax['stall']):.2f}; "
          f"keepalive (lazy) stall / step = {med(lazy['stall']) / med(lazy['clean']):.2f}")
    print(f"ratio resume keepalive / orbax = {resumes[savers[0].name] / resumes[savers[2].name]:.2f} "
          "(keepalive verifies every byte's checksum)")
    for saver in savers:
        saver.close()
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
