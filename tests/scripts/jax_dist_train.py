"""One process of a 2-process ``jax.distributed`` training on 127.0.0.1 (CPU, 2 host devices each: a
4-device global mesh), for tests/test_jax_distributed.py.

An NNX MLP whose weights (and so its Adam moments) are sharded over the global mesh, trained on a list
of batches (host numpy, the same on both processes), under keepalive's JAX ``DriveCheckpoint``
(``--mode keepalive``) or without it (``--mode plain``).

    python jax_dist_train.py RUN_DIR OUT_NPZ --process 0 --port 29650 [--mode plain] [--kill-at 7]
                             [--every 3]

``--kill-at N``: process 1 SIGKILLs itself right after optimizer step N (mid-epoch); process 0 is then
stuck in, or failed by, the next collective (the test ends it). Process 0 writes the final weights and
optimizer state to OUT_NPZ (gathered from every process) and prints ``DONE``. ``--control``: a resume
that puts none of the checkpoint's arrays back (the test's negative control). ``--mode group``: the
process group's checks (check-in, shared run folder) instead of a training.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

EPOCHS, BATCHES, WIDTH = 3, 5, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("out")
    ap.add_argument("--process", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", default="keepalive")
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--control", action="store_true")
    ap.add_argument("--term-at", type=int, default=0)
    a = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung run's stacks: kill -USR1 PID
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}", num_processes=2, process_id=a.process,
                               initialization_timeout=60)
    if a.mode == "group":
        return group_checks(a.run, a.process)
    import numpy as np
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("d",))

    def spread(x: np.ndarray, spec: P) -> jax.Array:
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])

    model = nnx.Sequential(nnx.Linear(4, WIDTH, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(WIDTH, 1, rngs=nnx.Rngs(1)))
    state = nnx.state(model)  # the weights sharded over the 4 devices of both processes, by their last axis
    nnx.update(model, jax.tree.map(lambda v: spread(np.asarray(v), P(*([None] * (v.ndim - 1)), "d")
                                                    if v.shape[-1] % 4 == 0 else P()), state))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):  # type: ignore[no-untyped-def]
        grads = nnx.grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        optimizer.update(model, grads)

    gen = np.random.default_rng(0)
    data = [(gen.normal(size=(8, 4)).astype(np.float32), gen.normal(size=(8, 1)).astype(np.float32))
            for _ in range(BATCHES)]
    step = 0

    def one(x: np.ndarray, y: np.ndarray) -> None:
        nonlocal step
        train_step(model, optimizer, spread(x, P()), spread(y, P()))
        step += 1
        if a.kill_at and step == a.kill_at and a.process == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.term_at and step == a.term_at and a.process == 1:  # a preemption's SIGTERM on one host only
            os.kill(os.getpid(), signal.SIGTERM)

    if a.mode == "plain":
        for _ in range(EPOCHS):
            for x, y in data:
                one(x, y)
    else:
        from keepalive.callbacks.jax import DriveCheckpoint

        if a.control:  # the negative control: the checkpoint's arrays are not put back (the fresh ones stay)
            from keepalive.callbacks._jax_orbax import OrbaxArrays

            OrbaxArrays.rebuild = lambda self, name, template, saved: template  # type: ignore[method-assign]

        ckpt = DriveCheckpoint(a.run, model=model, optimizer=optimizer, every=a.every, quiet=True,
                               track_globals=False)
        for _ in ckpt.epochs(EPOCHS):
            for x, y in ckpt.batches(data):
                one(x, y)
        print("RESUMED", ckpt.core.resumed_from is not None, "STEP", ckpt.step, flush=True)
    final = {**{f"model/{k}": v for k, v in nnx.to_flat_state(nnx.state(model))},
             **{f"opt/{k}": v for k, v in nnx.to_flat_state(nnx.state(optimizer))}}
    values = {"/".join(map(str, k)): v.get_value() for k, v in final.items()}
    arrays = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True) if not v.is_fully_addressable else v)
              for k, v in values.items()}
    if a.process == 0:
        np.savez(a.out, **arrays)
    print("DONE", flush=True)
    jax.distributed.shutdown()


def group_checks(run: str, process: int) -> None:
    """keepalive's process group over JAX's coordination service: a check-in every process reaches, the
    shared run folder, a folder that is each process's own (refused on both), a check-in of one
    process only (refused there, naming the other)."""
    from keepalive.distributed import GROUP, DistributedMisuseError

    print("GROUP", GROUP.active, GROUP.rank, GROUP.world_size, flush=True)
    GROUP.check_in("save()", "call it on every process")

    def folder_check(path: str) -> str:
        os.makedirs(path, exist_ok=True)
        try:
            GROUP.same_folder(path, lambda n, b: open(os.path.join(path, n), "wb").write(b),
                              lambda n: open(os.path.join(path, n), "rb").read(),
                              lambda n: os.remove(os.path.join(path, n)))
        except DistributedMisuseError as exc:
            return str(exc)
        return "shared"

    print("SHARED", folder_check(os.path.join(run, "shared")), flush=True)
    print("OWN", folder_check(os.path.join(run, f"own{process}"))[:60], flush=True)
    if process == 1:
        try:
            GROUP.check_in("save()", "call it on every process", timeout=1)
        except DistributedMisuseError as exc:
            print("MISUSE", exc, flush=True)
    GROUP.barrier()
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())
