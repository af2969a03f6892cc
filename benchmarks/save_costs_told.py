"""``every=1`` with a large state: how much slower the training runs, and the line keepalive says.

The same loop (3 x Linear(4096, 4096), SGD: 201 MB of parameters, the saved state; ``--batch`` rows
per step, on the CPU) runs ``--steps`` optimizer steps twice: without keepalive, then in
``ckpt.iterations(steps)`` with ``every=1`` into a temporary folder. Printed: both wall times, their
ratio, and keepalive's own lines (the cost warning of :mod:`keepalive.savecosts` among them), so the
figure it told can be set against the slowdown measured from outside.

    python benchmarks/save_costs_told.py [--steps 40] [--batch 1]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from keepalive.callbacks.torch import DriveCheckpoint


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(3)])
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    x = torch.randn(args.batch, 4096)

    def step(model, opt) -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    model, opt = build()
    started = time.perf_counter()
    for _ in range(args.steps):
        step(model, opt)
    plain = time.perf_counter() - started

    model, opt = build()
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    with tempfile.TemporaryDirectory() as folder:
        ckpt = DriveCheckpoint(f"{folder}/run", model=model, optimizer=opt, every=1, keep=2, track_globals=False)
        started = time.perf_counter()
        for _ in ckpt.iterations(args.steps):
            step(model, opt)
        saved = time.perf_counter() - started
        ckpt.close()
    print(f"state {size:.0f} MB, {args.steps} steps of batch {args.batch}: without keepalive {plain:.1f} s, "
          f"every=1 {saved:.1f} s = {saved / plain:.2f}x (saves took {100 * (1 - plain / saved):.0f} % of the time)")


if __name__ == "__main__":
    main()
