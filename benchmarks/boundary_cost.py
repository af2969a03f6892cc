"""What one boundary costs the training loop: ``Checkpointer.advance`` per batch (no save due), and a
torch loop's ``ckpt.batches()`` + optimizer step hook, against the same loop without keepalive.

    python benchmarks/boundary_cost.py [--batches 20000]

Prints microseconds per batch and the ratio to the bare loop.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from keepalive.callbacks.torch import DriveCheckpoint
from keepalive.core import Checkpointer


def per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=20000)
    args = p.parse_args()
    root = tempfile.mkdtemp()
    core = Checkpointer(os.path.join(root, "bare"), every=10 ** 9, quiet=True, background=False)

    def capture():
        return {"objects": {}}

    core.load()
    advance = per_call(lambda: core.advance(capture), args.batches)
    core.close()
    print(f"core.advance (no save due):           {advance:8.2f} us per batch")

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    data = DataLoader(TensorDataset(torch.zeros(args.batches, 4)), batch_size=1)

    def loop(batches) -> float:
        t0 = time.perf_counter()
        for _batch in batches:
            opt.step()  # the step hook runs; no gradients, so nothing is computed
        return (time.perf_counter() - t0) / args.batches * 1e6

    bare = loop(data)
    ckpt = DriveCheckpoint(os.path.join(root, "torch"), model=model, optimizer=opt, every=10 ** 9, quiet=True)
    with_ka = next(loop(ckpt.batches(data)) for _ in ckpt.epochs(1))
    ckpt.close()
    print(f"DataLoader + opt.step, bare:          {bare:8.2f} us per batch")
    print(f"the same through ckpt.batches():      {with_ka:8.2f} us per batch "
          f"(+{with_ka - bare:.2f} us, {with_ka / bare:.2f}x)")


if __name__ == "__main__":
    main()
