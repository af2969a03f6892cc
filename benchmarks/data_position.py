"""How long a resumed epoch takes to reach its saved position, per loader shape.

A 1M-sample map-style dataset (an item is its index: the fetch costs next to nothing, so the figures
are the positioning itself); the resume lands at 90 % of the epoch. For each shape:

* fresh: ``iter(loader)`` and its first batch (an epoch's start, the baseline);
* keepalive: ``LoaderReplay.iterate(start at 90 %)`` and its first batch (the states of the epoch's
  iter() restored, 900k indices generated and skipped, nothing fetched);
* accelerate: ``accelerate.skip_first_batches(loader, k)`` and its first batch (HF Trainer's way:
  skips whole batches of the batch sampler, no fetch, the order is not replayed);
* iterate: taking and dropping k batches of the loader (what a hand-written resume does; fetched and
  collated; timed on 1 % of the skip and scaled).

    python benchmarks/data_position.py [--samples 1000000] [--repeat 3]

Prints seconds and the ratio to the fresh start. Lightning has no positioning to compare: for a loader
without state_dict() its restart runs the interrupted epoch from its first batch (see the README).
"""
from __future__ import annotations

import argparse
import itertools
import time
import warnings

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, SubsetRandomSampler, WeightedRandomSampler

from keepalive import rng
from keepalive.callbacks._torch_replay import LoaderReplay


class Index(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def shapes(n: int):
    ds = Index(n)
    yield "shuffle=True", lambda: DataLoader(ds, batch_size=32, shuffle=True)
    yield "shuffle=True, 2 workers", lambda: DataLoader(ds, batch_size=32, shuffle=True, num_workers=2)
    yield "WeightedRandomSampler", lambda: DataLoader(ds, batch_size=32, sampler=WeightedRandomSampler(
        torch.ones(n), n))
    yield "batch_sampler=Subset", lambda: DataLoader(ds, batch_sampler=BatchSampler(
        SubsetRandomSampler(range(n)), 32, False))


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    n = args.samples
    at = int(n * 0.9) // 32 * 32
    k = at // 32
    print(f"{n} samples, batch 32, resume at sample {at} (batch {k}); best of {args.repeat}")
    print(f"{'loader':26s} {'fresh s':>8s} {'keepalive s':>12s} {'x fresh':>8s} {'accelerate s':>13s} "
          f"{'x fresh':>8s} {'iterate s':>10s} {'x fresh':>8s}")
    for name, make in shapes(n):
        print(row(name, make(), at, k, args.repeat))


def row(name: str, loader: DataLoader, at: int, k: int, repeat: int) -> str:
    """One loader shape's figures, positioned at sample ``at`` (batch ``k``)."""
    from accelerate import skip_first_batches

    fresh = timed(lambda: next(iter(loader)), repeat)
    replay = LoaderReplay(loader)
    assert replay.mid_epoch, replay.why_not
    list(itertools.islice(replay.iterate(), 1))  # an epoch's iter(): its states recorded
    start = replay.position(at, k)
    now = rng.capture()
    ours = timed(lambda: next(replay.iterate(start, lambda: rng.restore(now))), repeat)
    acc = timed(lambda: next(iter(skip_first_batches(loader, k))), repeat)
    part = max(1, k // 100)
    it_s = timed(lambda: next(itertools.islice(iter(loader), part, None)), 1) * (k / part)
    replay.close()
    return (f"{name:26s} {fresh:8.3f} {ours:12.3f} {ours / fresh:8.2f} {acc:13.3f} {acc / fresh:8.2f} "
            f"{it_s:10.2f} {it_s / fresh:8.0f}")


if __name__ == "__main__":
    main()
