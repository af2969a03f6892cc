"""Does a slow checkpoint destination slow the training loop down?

A real torch training loop (an MLP whose state -- weights plus SGD momentum -- is about
``--size-mb``) checkpoints every ``--every`` steps with the torch ``DriveCheckpoint`` to

* ``fast``        a local folder, written directly (the baseline);
* ``fast+spool``  the same folder through the local spool (what spooling itself costs);
* ``slow``        a destination that sleeps ``--ms-per-mb`` per MB written (the ``faulty://``
                  filesystem of tests/faultyfs.py, default 50 ms/MB = 20 MB/s, a Drive-like rate),
                  written directly (``KEEPALIVE_SPOOL_MODE=never``): the loop waits for the previous
                  write at each save;
* ``slow+spool``  the same slow destination through the spool (the default for such destinations).

It prints the step time (mean, median, p95, max) of each, the ratio of the mean to ``fast``, and how
long the final flush waited for the uploads.

    python benchmarks/slow_destination.py [--size-mb 64] [--steps 150] [--every 15] [--ms-per-mb 50]
                                          [--repeat 3]

Goal: ``slow+spool`` within a few percent of ``fast``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import faultyfs  # noqa: E402  (registers faulty://)
from keepalive.callbacks.torch import DriveCheckpoint  # noqa: E402
from keepalive.store import MANIFEST  # noqa: E402


def build(size_mb: int):
    # two layers d x h and h x d; weights are half the state, momentum buffers the other half
    d = 1024
    h = max(64, int(size_mb * 2**20 / 2 / 4 / (2 * d)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.ReLU(), torch.nn.Linear(h, d))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return model, opt, d


def run(name: str, url: str, mode: str, args, root: str):
    os.environ["KEEPALIVE_SPOOL_MODE"] = mode
    model, opt, d = build(args.size_mb)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, d, generator=g), torch.randn(64, d, generator=g)) for _ in range(8)]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])),
        batch_size=64, shuffle=True)
    ckpt = DriveCheckpoint(url, model=model, optimizer=opt, every=args.every, keep=3, quiet=True)
    times = []
    epochs = -(-args.steps // len(loader))
    t_start = last = time.perf_counter()
    for _ in ckpt.epochs(epochs):  # its end flushes: waits for the last write and the uploads
        for x, y in ckpt.batches(loader):
            now = time.perf_counter()
            times.append(now - last)
            last = now
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            last_step_end = time.perf_counter()
    ckpt.close()
    end = time.perf_counter()
    times = sorted(times[2:])  # the first steps warm up
    return {"name": name, "mean": statistics.mean(times), "median": statistics.median(times),
            "p95": times[int(0.95 * (len(times) - 1))], "max": times[-1], "train": last_step_end - t_start,
            "flush": end - last_step_end, "steps": len(times) + 2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=64)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=15)
    ap.add_argument("--ms-per-mb", type=float, default=50.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per destination (interleaved)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = tempfile.mkdtemp(prefix="keepalive-slowdest-")
    os.environ["KEEPALIVE_SPOOL"] = os.path.join(root, "spool")
    os.environ["KEEPALIVE_PROGRESS"] = "0"
    control = os.path.join(root, "control.json")
    os.environ[faultyfs.CONTROL_ENV] = control
    faultyfs.write_control(control, sleep_per_mb=args.ms_per_mb / 1000.0)
    model, opt, _ = build(args.size_mb)
    state = sum(p.numel() * 4 for p in model.parameters()) * 2
    print(f"state ~{state / 2**20:.0f} MiB (weights + momentum), a save every {args.every} steps, "
          f"slow destination: {args.ms_per_mb:.0f} ms per MB written "
          f"(~{state / 1e6 * args.ms_per_mb / 1000:.1f} s a checkpoint); {os.cpu_count()} CPU(s)")
    configs = [("fast", os.path.join(root, "fast", "run"), "never"),
               ("fast+spool", os.path.join(root, "fast-spool", "run"), "always"),
               ("slow", f"faulty://{root}/slow/run", "never"),
               ("slow+spool", f"faulty://{root}/slow-spool/run", "always")]
    runs = {name: [] for name, _, _ in configs}
    try:
        for rep in range(args.repeat):  # interleaved, so drifting machine load hits every config
            for name, url, mode in configs:
                url = url.replace("/run", f"/run{rep}")
                r = run(name, url, mode, args, root)
                folder = url.split("://", 1)[-1]
                r["at_dest"] = sum(1 for n in os.listdir(folder)
                                   if os.path.exists(os.path.join(folder, n, MANIFEST)))
                runs[name].append(r)
                print(f"  {name:<11} #{rep + 1}: {r['steps']} steps in {r['train']:.1f} s (mean "
                      f"{r['mean'] * 1e3:.1f} ms), then flush {r['flush']:.1f} s; {r['at_dest']} checkpoints "
                      "at the destination", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(name, key):
        return statistics.median(r[key] for r in runs[name])

    base = med("fast", "mean")
    print()
    print(f"median of {args.repeat} run(s) per destination:")
    print(f"{'destination':<12} {'mean ms':>8} {'median':>8} {'p95':>8} {'max':>8} {'vs fast':>8} "
          f"{'train s':>8} {'flush s':>8}")
    for name, _, _ in configs:
        print(f"{name:<12} {med(name, 'mean') * 1e3:8.1f} {med(name, 'median') * 1e3:8.1f} "
              f"{med(name, 'p95') * 1e3:8.1f} {med(name, 'max') * 1e3:8.1f} {med(name, 'mean') / base:7.3f}x "
              f"{med(name, 'train'):8.1f} {med(name, 'flush'):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
